"""What a shipped config builds, independent of how the configs and classes are laid out.

Trainer settings, callbacks, task and data hyper-parameters, the network's tensor shapes (hashed), its per-layer head
budgets and its dropout rates. ``tests/data/main_settings.json`` holds these for every shipped experiment as they were
before the configs were restructured (commit 00a7501, read through that commit's CLI), so the restructured configs
can be checked to build exactly the same experiments.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

# Required paths of the ImageNet configs: any value parses, nothing is read before fit.
REQUIRED = {"vit_s": ["--data.init_args.data_dir", "/data/imagenet"],
            "vit_b": ["--data.init_args.data_dir", "/data/imagenet"],
            "dit_s2": ["--data.init_args.data_path", "/data/imagenet/train"],
            "dit_b2": ["--data.init_args.data_path", "/data/imagenet/train"],
            "dit_l2": ["--data.init_args.data_path", "/data/imagenet/train"],
            "dit_xl2": ["--data.init_args.data_path", "/data/imagenet/train"],
            # init_from's config.json, which the task reads before building: Meta-Llama-3-8B's, with no hub here.
            "llama3_8b_moh": ["--model.init_args.hf_config",
                              (Path(__file__).parent / "data" / "llama3_8b_config.json").read_text()]}
_CALLBACK_ATTRIBUTES = ("monitor", "mode", "save_last", "_every_n_train_steps", "save_top_k", "every_n_steps",
                        "num_per_class", "max_classes", "cfg_scale", "logging_interval", "log_every_n_steps",
                        "decay", "collapse_windows")


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict
        return _plain(asdict(value))
    return repr(value)


def _flat(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value
    return out


def settings(config: str) -> dict:
    """The settings of one shipped config, its model built on the meta device (no memory, no initialisation)."""
    from moh_lightning.layers import MoHHeads, activated_head_fraction
    from moh_lightning.trainer_cli import MoHLightningCLI

    args = ["--config", config, *REQUIRED.get(config.rsplit("_", 1)[0], []),
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto"]
    with torch.device("meta"):
        cli = MoHLightningCLI(args=args, run=False)
        task = cli.model
        if getattr(task, "model", None) is None:
            task.configure_model()
    trainer = cli.trainer
    out = {"seed": cli.config.get("seed_everything")}
    out["trainer"] = {k: _plain(getattr(trainer, k, None)) for k in (
        "max_epochs", "max_steps", "gradient_clip_val", "accumulate_grad_batches", "log_every_n_steps",
        "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps")}
    out["trainer"]["precision"] = cli.config["trainer"]["precision"]
    callbacks = [[type(cb).__name__, {k: _plain(v) for k, v in vars(cb).items() if k in _CALLBACK_ATTRIBUTES}]
                 for cb in trainer.callbacks]
    out["callbacks"] = sorted(callbacks, key=json.dumps)
    hparams = {k: _plain(v) for k, v in task.hparams.items() if not k.startswith("_")}
    out["task"] = {"class": type(task).__name__, "hparams": _flat("", hparams, {})}
    data = cli.datamodule
    out["data"] = {"class": type(data).__name__,
                   "hparams": _flat("", {k: _plain(v) for k, v in data.hparams.items() if not k.startswith("_")}, {})}
    shapes = sorted(f"{k}:{tuple(v.shape)}" for k, v in task.state_dict().items())
    out["state_dict"] = {"tensors": len(shapes), "parameters": sum(p.numel() for p in task.parameters()),
                         "sha256": hashlib.sha256("\n".join(shapes).encode()).hexdigest()}
    layers = []
    for m in task.modules():
        if isinstance(m, MoHHeads):
            r = m.router
            layers.append([m.num_heads, m.num_kv_heads, m.head_dim, m.causal, m.execution,
                           None if r is None else type(r).__name__,
                           None if r is None else r.num_shared_heads, None if r is None else r.top_k,
                           None if r is None else getattr(r, "type_router", None) is not None])
    out["attention_layers"] = layers
    out["head_fraction"] = activated_head_fraction(task)  # not in the snapshot: checked against the config's name
    # Stochastic regularisers shape training but not the state dict: DropPath, Dropout, label dropout.
    out["dropout"] = [[type(m).__name__, float(getattr(m, a))] for m in task.modules()
                      for a in ("drop_prob", "p", "dropout_prob") if isinstance(getattr(m, a, None), float)]
    return out
