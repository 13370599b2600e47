"""The authors' MoH-DiT (SkyworkAI/MoH ``MoH-DiT/models.py``) in the suite's DiT, and ``moh load-authors-dit``.

Their released MoH-DiT-XL/2-90 is the suite's ``dit_xl2_90.yaml`` (the same per-layer heads, head width 72 and head
budgets). Their state dict differs from the suite's in two places only:

* the routers of each ``blocks.{i}.attn``: ``wg`` (routed heads, ``Linear(dim, h - h_s)``), ``wg_0`` (shared / routed
  balance, ``Linear(dim, 2)``) and ``wg_1`` (shared heads, ``Linear(dim, h_s)``) are ``router.routed_router``,
  ``router.type_router`` and ``router.shared_router``;
* ``pos_embed`` is a frozen parameter there and a fixed, unsaved buffer here: it is checked to be the sin-cos
  embedding the suite computes, then dropped.

Everything else (patch, timestep and label embedders, ``attn.qkv`` / ``attn.proj`` in the same q-k-v x head x width
order, timm's ``mlp.fc1`` / ``fc2``, ``adaLN_modulation.1``, ``final_layer.*``) has the same names and shapes.

Their gates, term by term against ``MoHRouter`` (``layers/routers.py``), with a token's x:

* routed: ``softmax(wg x)``, the top-``routed_head`` kept (``routed_head`` is their name for k), renormalised over the
  kept with the sum clamped at the dtype's eps, times k: ``MoHRouter``'s routed gates, the same top-k on the same
  softmax;
* shared: ``softmax(wg_1 x) * shared_head``: ``MoHRouter``'s shared gates;
* both groups: shared times ``2 * softmax(wg_0 x)[0]``, routed times ``2 * softmax(wg_0 x)[1]``: ``MoHRouter``'s
  ``type_router`` (first logit for the shared group), built when two-stage routing has both groups;
* layers with k = 0 and every head shared (XL/2-90's first 19 blocks): ``softmax(wg_1 x) * h`` and no ``wg_0``:
  ``MoHRouter`` with no routed heads builds neither ``routed_router`` nor ``type_router``;
* layers with no shared head: routed gates only, as ``MoHRouter`` with ``num_shared_heads=0``.

So the loaded model computes their function with no option added to the router. Their code cannot run a layer with
one shared head and routed heads (it never builds ``wg_1`` there but calls it); the suite gives that head gate 1,
which is what a softmax over one logit would give. ``tests/test_authors_dit.py`` checks the loaded model against a
re-computation written from their formulas, and ``results/authors_models.md`` against their own code.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from moh_lightning import weights
from moh_lightning.configs import load_config
from moh_lightning.models.dit import DiT, DiTConfig, sincos_pos_embed_2d
from moh_lightning.tasks.checkpoints import one_line_errors, write_checkpoint
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion

#: The authors' released MoH-DiT: hub repo and the shipped experiment config that is the same network.
AUTHORS_DIT = {"MoH-DiT-XL/2-90": {"hub": "Chat-UniVi/MoH-DiT-XL-90", "experiment": "dit_xl2_90.yaml"}}
#: Their router names (in ``blocks.{i}.attn``) -> the suite's (in ``blocks.{i}.attn.router``).
ROUTER_NAMES = {"wg": "routed_router", "wg_0": "type_router", "wg_1": "shared_router"}
#: Sampling as their FID evaluation (``sample_ddp.py``): 250 DDPM steps, guidance 1.5 on 3 of the 4 latent channels.
AUTHORS_SAMPLING = {"sampler": "ddpm", "sample_steps": 250, "cfg_scale": 1.5, "cfg_channels": 3}


def read_state_dict(source: str) -> dict[str, torch.Tensor]:
    """The weights of a local file or a hub file (``weights.read_state_dict``): a plain state dict, or their
    ``train.py`` checkpoint's EMA weights, the ones their sampling loads (``download.find_model``)."""
    return weights.read_state_dict(source, "--source")


def authors_to_dit_state_dict(state: dict[str, torch.Tensor], config: DiTConfig) -> dict[str, torch.Tensor]:
    """Their MoH-DiT (or DiT) state dict under the suite's ``DiT`` names; ``pos_embed`` checked and dropped."""
    out = {}
    for name, value in state.items():
        prefix, _, leaf = name.rpartition(".")
        block, _, module = prefix.rpartition(".")
        if name == "pos_embed":
            grid = config.input_size // config.patch_size
            expected = sincos_pos_embed_2d(config.embed_dim, grid).unsqueeze(0)
            if value.shape != expected.shape:
                raise ValueError(f"pos_embed has shape {tuple(value.shape)} but the config's {grid}x{grid} patches of "
                                 f"width {config.embed_dim} need {tuple(expected.shape)}: check input_size, patch_size "
                                 f"and embed_dim.")
            gap = (value.float() - expected).abs().max().item()
            if gap > 1e-5:
                raise ValueError(f"pos_embed differs from DiT's fixed sin-cos embedding by {gap:.3g}: this suite keeps "
                                 f"the embedding fixed (not a weight), so these weights cannot be loaded as they are.")
            continue
        if module in ROUTER_NAMES and block.endswith(".attn") and leaf == "weight":
            name = f"{block}.router.{ROUTER_NAMES[module]}.weight"
        out[name] = value
    return out


def load_authors_weights(model: DiT, state: dict[str, torch.Tensor]) -> DiT:
    """Copies the authors' state dict into ``model``; every key of both must be used, with the same shapes."""
    mapped, expected = authors_to_dit_state_dict(state, model.config), model.state_dict()
    missing = [name for name in expected if name not in mapped]
    unexpected = [name for name in mapped if name not in expected]
    reshaped = [f"{name} {tuple(mapped[name].shape)} vs {tuple(value.shape)}" for name, value in expected.items()
                if name in mapped and mapped[name].shape != value.shape]
    if missing or unexpected or reshaped:
        raise ValueError(f"the authors' weights do not match the config: missing {_few(missing)}, unexpected "
                         f"{_few(unexpected)}, other shapes (theirs vs config) {_few(reshaped)}; give the experiment "
                         f"config of that model (per-layer num_heads, head_dim, num_shared_heads and top_k).")
    model.load_state_dict(mapped)
    return model.eval()


def load_authors_dit(source: str | dict[str, torch.Tensor], config: DiTConfig) -> DiT:
    """A ``DiT`` of ``config`` with the authors' weights (a path, hub id or their state dict), every key used."""
    return load_authors_weights(DiT(config), read_state_dict(source) if isinstance(source, str) else source)


def _few(names: list[str], count: int = 6) -> str:
    return str(names[:count])[:-1] + (", ...]" if len(names) > count else "]")


def experiment_init_args(experiment: str) -> dict:
    """The merged ``model`` / ``data`` sections of an experiment config, the configs it ``extends`` first (resolved as
    ``moh fit --config`` resolves it: a file, else the shipped config of that name)."""
    return load_config(experiment)


def load_authors_dit_tool(
        source: str = AUTHORS_DIT["MoH-DiT-XL/2-90"]["hub"],
        out: str = "authors_dit.ckpt",
        experiment: str = AUTHORS_DIT["MoH-DiT-XL/2-90"]["experiment"],
        cfg_scale: float = AUTHORS_SAMPLING["cfg_scale"],
        cfg_channels: int | None = AUTHORS_SAMPLING["cfg_channels"],
) -> Path:
    """Loads the authors' MoH-DiT into the suite's DiT and writes a checkpoint ``moh sample`` reads.

    Sampling defaults are the authors' FID protocol (``sample_ddp.py``): 250 DDPM steps, guidance 1.5 on 3 of the 4
    latent channels, SD-VAE ``ft-ema``; ``moh sample`` options override them.

    Args:
        source: Their weights: a ``.pt`` file (a state dict or a ``train.py`` checkpoint, whose EMA is used), a hub
            repo id, or ``owner/name/file``.
        out: The checkpoint to write.
        experiment: The experiment config of the same network (``dit_xl2_90.yaml`` for MoH-DiT-XL/2-90).
        cfg_scale: Default classifier-free guidance of ``moh sample``.
        cfg_channels: Latent channels guided by default (their code guides 3; None guides all).
    """
    with one_line_errors("load-authors-dit"):
        config = experiment_init_args(experiment)
    model_section, data_section = config.get("model") or {}, config.get("data") or {}
    if not str(model_section.get("class_path", "")).endswith("ClassConditionalDiffusion"):
        raise SystemExit(f"moh load-authors-dit: --experiment {experiment}: not a diffusion experiment "
                         f"(model.class_path {model_section.get('class_path')!r}).")
    init_args = dict(model_section.get("init_args") or {})
    arch = DiTConfig(**init_args.pop("arch", {}))
    hparams = {**init_args, "sampler": AUTHORS_SAMPLING["sampler"], "sample_steps": AUTHORS_SAMPLING["sample_steps"],
               "cfg_scale": cfg_scale, "cfg_channels": cfg_channels}
    with one_line_errors("load-authors-dit"):
        state = read_state_dict(source)  # before building the model: a bad source stops at once
        task = ClassConditionalDiffusion(arch, **hparams)
        load_authors_weights(task.model, state)
    data_hparams = {**(data_section.get("init_args") or {}),
                    "provenance": f"The authors' MoH-DiT weights {source} (SkyworkAI/MoH), loaded by "
                                  f"`moh load-authors-dit` as {Path(experiment).name}."}
    path = write_checkpoint(out, ClassConditionalDiffusion, {"arch": asdict(arch), **hparams}, task.state_dict(),
                            data_hparams)
    print(f"wrote {path}: the authors' weights as {Path(experiment).name} ({arch.activated_fraction:.1%} of heads "
          f"active); sample with `moh sample --checkpoint {path}`")
    return path


__all__ = ["AUTHORS_DIT", "AUTHORS_SAMPLING", "ROUTER_NAMES", "authors_to_dit_state_dict", "experiment_init_args",
           "load_authors_dit", "load_authors_dit_tool", "load_authors_weights", "read_state_dict"]
