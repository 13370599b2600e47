"""MoH-TransNeXt: the named models at the authors' sizes, per-stage budgets, the task, dashboards, timm's hub format."""
from __future__ import annotations

import copy
import json
import re
from dataclasses import asdict, replace

import pytest
import timm
import torch

from moh_lightning.layers import MoHAttention, moh_layers, pop_load_balance_loss
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.transnext import (
    GENERIC_TRANSNEXT,
    NAMED_MODELS,
    AggregatedAttention,
    TransNeXt,
    TransNeXtAttention,
    TransNeXtConfig,
    transnext_config,
)
from moh_lightning.models.vit import ViTConfig
from moh_lightning.tasks.classification import ImageClassifier, TransNeXtClassifier
from moh_lightning.tools.export_timm import export_timm

# Parameters of the authors' own modules (SkyworkAI/MoH MoH-ViT/transnext.py; DaiShiResearch/TransNeXt for the dense
# models), counted outside the project, the paper's Tab. 1 (millions) and the share of heads a token uses.
AUTHORS = {
    "moh_transnext_small_80": (49_910_548, 50, 0.800), "moh_transnext_small_75": (49_910_548, 50, 0.753),
    "moh_transnext_base_75": (90_020_632, 90, 0.750), "moh_transnext_base_50": (90_023_512, 90, 0.500),
    "transnext_small": (49_741_564, 50, 1.0), "transnext_base": (89_721_496, 90, 1.0),
    "transnext_micro": (12_809_304, None, 1.0), "moh_transnext_micro_75": (None, None, 0.756),
}
TINY = TransNeXtConfig(img_size=32, patch_size=2, in_chans=1, num_classes=10, embed_dim=[8, 16, 16, 16],
                       depth=[1, 1, 2, 1], num_heads=[2, 4, 4, 4], mlp_ratio=2.0, sr_ratio=[4, 2, 2, 1],
                       drop_path_rate=0.0, moh=MoHConfig(num_shared_heads=[2, 1, 0, 2], top_k=[0, 2, 2, 1]))


@pytest.fixture
def meta_init_skipped(monkeypatch):
    """No initialisation for networks built on the meta device, whose weights have no values to set: there torch runs
    its Python reference ops for every truncated normal, seconds a large model, and nothing checked here reads them."""
    monkeypatch.setattr(TransNeXt, "init_weights", lambda self: None)


@pytest.mark.parametrize("name", sorted(set(NAMED_MODELS) - {GENERIC_TRANSNEXT}))
def test_named_models_have_the_authors_sizes_and_head_budgets(name, meta_init_skipped):
    with torch.device("meta"):
        model = timm.create_model(name)
    parameters, paper_millions, active = AUTHORS[name]
    count = sum(p.numel() for p in model.parameters())
    if parameters is not None:
        assert count == parameters
    if paper_millions is not None:
        assert round(count / 1e6) == paper_millions
    assert model.arch.activated_fraction == pytest.approx(active, abs=5e-4)
    routed = moh_layers(model)
    assert all(isinstance(layer, (AggregatedAttention, TransNeXtAttention)) for layer in routed)
    assert bool(routed) == name.startswith("moh")


@pytest.mark.slow
def test_micro_model_runs_on_cpu_at_224():
    torch.manual_seed(0)
    model = timm.create_model("moh_transnext_micro_75").eval()
    with torch.no_grad():
        features = model.forward_features(torch.randn(1, 3, 224, 224))
        logits = model.forward_head(features)
    assert features.shape == (1, 384, 7, 7)
    assert logits.shape == (1, 1000) and torch.isfinite(logits).all()


def test_budgets_per_stage_or_per_block_and_errors_name_the_key():
    per_block = MoHConfig(num_shared_heads=[2] + [1] + [0, 0] + [2], top_k=[0, 2, 2, 2, 1])
    by_stage = TransNeXt(TINY)
    by_block = TransNeXt(TransNeXtConfig(**{**asdict(TINY), "moh": per_block}))
    budgets = [(m.router.num_shared_heads, m.router.top_k) for m in moh_layers(by_stage)]
    assert budgets == [(m.router.num_shared_heads, m.router.top_k) for m in moh_layers(by_block)]
    assert budgets == [(2, 0), (1, 2), (0, 2), (0, 2), (2, 1)]
    with pytest.raises(ValueError, match="moh.top_k has 3 entries: give one per stage"):
        TransNeXtConfig(**{**asdict(TINY), "moh": MoHConfig(num_shared_heads=1, top_k=[1, 1, 1])})
    with pytest.raises(ValueError, match="top_k=5"):
        TransNeXtConfig(**{**asdict(TINY), "moh": MoHConfig(num_shared_heads=0, top_k=5)})
    with pytest.raises(ValueError, match="arch.embed_dim has 3 entries"):
        TransNeXtConfig(embed_dim=[8, 16, 32])
    with pytest.raises(ValueError, match="a 32x32 token grid reached an attention layer built for 16x16"):
        TransNeXt(TINY)(torch.randn(1, 1, 64, 64))


def _forward_backward(model: TransNeXt, x: torch.Tensor):
    x = x.clone().requires_grad_()
    out = model(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ((out * weight).sum() + pop_load_balance_loss(model)).backward()
    return out, x.grad, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
def test_head_sparse_execution_equals_masked_forward_and_backward(monkeypatch):
    """Every stage's layout (all heads shared, shared and routed, routed only, full attention) computed only for the
    selected (token, head) pairs gives the masked execution's logits and gradients (inputs, weights, routers)."""
    from moh_lightning.layers import execution

    calls = []
    for owner, name in ((AggregatedAttention, "_attend_routed"), (execution, "head_sparse_attention")):
        function = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, f=function, n=name, **k: calls.append(n) or f(*a, **k))
    torch.manual_seed(0)
    masked = TransNeXt(TransNeXtConfig(**{**asdict(TINY), "moh": replace(TINY.moh, execution="masked")})).train()
    with torch.no_grad():  # every term of the similarity and the mixing matters, not just its initial scale
        for parameter in masked.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    sparse = copy.deepcopy(masked)
    for layer in moh_layers(sparse):
        layer.execution = "sparse"
    x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(2))
    out_m, dx_m, grads_m = _forward_backward(masked, x)
    assert not calls
    out_s, dx_s, grads_s = _forward_backward(sparse, x)
    assert calls == ["_attend_routed"] * 3 + ["head_sparse_attention"]   # stage 1 shares all its heads
    torch.testing.assert_close(out_s, out_m, rtol=0, atol=1e-5)
    torch.testing.assert_close(dx_s, dx_m, rtol=0, atol=1e-5)
    assert any(".router." in name for name in grads_m)
    for name, grad in grads_m.items():
        # Gradients of the order of one reach the stem through every stage: fp32 rounding grows with them.
        torch.testing.assert_close(grads_s[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_moh_layers_load_balance_and_dashboards_see_every_stage():
    torch.manual_seed(0)
    model = TransNeXt(TINY).train()
    model(torch.randn(3, 1, 32, 32)).sum().backward()
    layers = moh_layers(model)
    assert [layer.num_heads for layer in layers] == [2, 4, 4, 4, 4]
    assert all(isinstance(layer, MoHAttention) for layer in layers)
    assert [tuple(layer.last_gates.shape) for layer in layers] == [(3, 256, 2), (3, 64, 4), (3, 16, 4), (3, 16, 4),
                                                                   (3, 4, 4)]
    # Each token keeps its shared heads and top-k routed ones: the gates' non-zeros are the budget.
    assert [int((layer.last_gates[0, 0] > 0).sum()) for layer in layers] == [2, 3, 2, 2, 3]
    loss = pop_load_balance_loss(model)
    assert loss is not None and torch.isfinite(loss)


@pytest.mark.slow
def test_head_load_dashboards_log_every_transnext_stage(run_dir):
    """A short run of the embedded TransNeXt config: the dashboards find its MoH layers in every stage."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moh_lightning.cli import main

    main(["fit", "--config", "moh_transnext_mnist_75.yaml", "--trainer.max_steps=2", "--trainer.log_every_n_steps=1",
          "--trainer.limit_val_batches=1", "--data.init_args.batch_size=8",
          "--model.init_args.arch.embed_dim=[8, 16, 16, 16]", "--model.init_args.arch.num_heads=[2, 4, 4, 4]",
          "--model.init_args.arch.depth=[1, 1, 1, 1]", "--model.init_args.arch.moh.num_shared_heads=[2, 1, 0, 2]",
          "--model.init_args.arch.moh.top_k=[0, 2, 2, 1]"])
    # The budget typed here is 71% of the heads: the run is named for it.
    events = EventAccumulator(str(next((run_dir / "runs" / "moh_transnext_mnist_71").glob("version_*"))),
                              size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = " ".join(tag for kind in events.Tags().values() if isinstance(kind, list) for tag in kind)
    # Layers 1-3 have routed heads (stage 1 shares both of its heads): each gets its own per-layer series.
    assert {f"layer_0{i}" for i in (1, 2, 3)} <= set(re.findall(r"layer_\d\d", tags))


def test_classifier_recipe_on_transnext():
    task = TransNeXtClassifier(arch=asdict(TINY), lr=2e-3, pretrained=None)  # a checkpoint's hparams hold a dict
    assert isinstance(task.model, TransNeXt) and task.hparams.lr == 2e-3 and "pretrained" in task.hparams
    decay, no_decay = task.parameter_groups(0.05)
    names = {id(p): n for n, p in task.model.named_parameters()}
    decayed = {names[id(p)].split(".")[-1] for p in decay["params"]}
    exempt = {names[id(p)].rsplit(".", 2)[-2] + "." + names[id(p)].split(".")[-1] for p in no_decay["params"]}
    assert {"learnable_tokens", "learnable_bias", "weight"} == decayed
    assert {"fc1.weight", "fc2.weight"} <= exempt  # the position-bias MLP (cpb.fc1 / cpb.fc2), as TransNeXt
    assert not any(".cpb." in names[id(p)] for p in decay["params"])
    assert isinstance(ImageClassifier(arch=ViTConfig(img_size=32, patch_size=8, embed_dim=32, depth=1,
                                                    num_heads=4)).model, torch.nn.Module)


def test_command_line_overrides_keep_a_transnext():
    from moh_lightning.trainer_cli import MoHLightningCLI

    cli = MoHLightningCLI(args=["--config", "moh_transnext_mnist_75.yaml", "--model.init_args.arch.moh.top_k=[0,0,2,2]",
                                "--trainer.logger=false"], run=False)
    assert isinstance(cli.model, TransNeXtClassifier)
    assert [layer.router.top_k for layer in moh_layers(cli.model.model)] == [0, 0, 2, 2, 2, 2]


def _checkpoint(tmp_path, task, data: dict) -> str:
    path = tmp_path / "run.ckpt"
    torch.save({"hyper_parameters": dict(task.hparams), "state_dict": task.state_dict(),
                "datamodule_hyper_parameters": data}, path)
    return str(path)


def test_export_timm_round_trips_a_transnext_and_pushes_through_huggingface_hub(tmp_path, monkeypatch):
    torch.manual_seed(0)
    task = TransNeXtClassifier(arch=TINY).eval()
    checkpoint = _checkpoint(tmp_path, task, {"img_size": 32, "crop_scale": (0.85, 1.0)})

    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls.append(("create_repo", repo_id, private))
            return type("Repo", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, commit_message):
            calls.append(("upload_folder", repo_id, sorted(p.name for p in __import__("pathlib").Path(
                folder_path).iterdir())))
            return "https://huggingface.co/me/tiny/commit/0"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    folder = export_timm(checkpoint, str(tmp_path / "out"), push_to="me/tiny", private=True, token="t")
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "moh_transnext"  # a tiny network is none of the registered models
    assert config["model_args"]["moh"]["top_k"] == [0, 2, 2, 1]
    assert config["pretrained_cfg"]["mean"] == [0.1307] and config["pretrained_cfg"]["input_size"] == [1, 32, 32]
    assert "top-[0, 2, 2, 1]" in (folder / "README.md").read_text()
    assert calls == [("token", "t"), ("create_repo", "me/tiny", True),
                     ("upload_folder", "me/tiny", ["README.md", "config.json", "model.safetensors"])]

    images = torch.randn(2, 1, 32, 32)
    expected = task.model(images)
    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    torch.testing.assert_close(loaded(images), expected, rtol=0, atol=0)
    file_only = timm.create_model(config["architecture"], pretrained=True, **config["model_args"],
                                  pretrained_cfg_overlay={"file": str(folder / "model.safetensors"),
                                                          "num_classes": config["num_classes"]}).eval()
    torch.testing.assert_close(file_only(images), expected, rtol=0, atol=0)


def test_export_names_a_registered_model_only_when_the_network_is_that_model():
    from moh_lightning.models.vit import named_vit_config
    from moh_lightning.tools.export_timm import registered_name

    fine_tuned = named_vit_config("moh_vit_small_patch16_224_75", num_classes=10, drop_path_rate=0.0)
    assert registered_name(fine_tuned) == ("moh_vit_small_patch16_224_75", {"num_classes": 10, "drop_path_rate": 0.0})
    tiny = ViTConfig(embed_dim=128, depth=6, num_heads=8, moh=MoHConfig(num_shared_heads=2, top_k=4))
    name, args = registered_name(tiny)
    assert name == "moh_vit" and args["depth"] == 6 and args["embed_dim"] == 128


def test_export_timm_round_trips_a_moh_vit_and_refuses_other_checkpoints(tmp_path, capsys):
    torch.manual_seed(0)
    arch = ViTConfig(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=3,
                     moh=MoHConfig(num_shared_heads=1, top_k=[2, 1]))
    task = ImageClassifier(arch=arch, class_names=["circle", "cross", "square"]).eval()
    folder = export_timm(_checkpoint(tmp_path, task, {"img_size": 32, "data_dir": "/data"}), str(tmp_path / "vit"))
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "moh_vit" and config["model_args"]["depth"] == 2
    assert config["label_names"] == ["circle", "cross", "square"]  # the class folders' names, as timm keeps them
    printed = capsys.readouterr().out
    assert f"wrote {folder}: moh_vit (ViT, 2 layers of width 32" in printed and f"local-dir:{folder}" in printed
    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded(images), task.model(images), rtol=0, atol=0)
    assert [block.attn.active_heads for block in loaded.blocks] == [3, 2]
    assert list(loaded.pretrained_cfg["label_names"]) == ["circle", "cross", "square"]

    torch.save({"hyper_parameters": {"arch": {"vocab_size": 9}}, "state_dict": {"model.embed.weight": torch.zeros(1)}},
               tmp_path / "lm.ckpt")
    with pytest.raises(SystemExit, match="is a LanguageModel checkpoint, and export-timm takes .* moh export-hf"):
        export_timm(str(tmp_path / "lm.ckpt"), str(tmp_path / "x"))


@pytest.mark.slow
def test_named_transnext_configs_are_the_shipped_experiments(meta_init_skipped):
    from moh_lightning.trainer_cli import MoHLightningCLI

    for name, config in [("moh_transnext_small_75", "moh_transnext_small_75.yaml"),
                         ("moh_transnext_base_50", "moh_transnext_base_50.yaml"),
                         ("transnext_base", "transnext_base_100.yaml")]:
        with torch.device("meta"):
            cli = MoHLightningCLI(args=["--config", config, "--data.init_args.data_dir", "/data/imagenet",
                                        "--trainer.logger=false"], run=False)
        assert asdict(cli.model.model.arch) == asdict(transnext_config(name))
