"""The authors' released MoH-ViT (TransNeXt) checkpoints load into the suite's TransNeXt and compute their function:
logits, gates and load-balance losses of their own code (SkyworkAI/MoH ``MoH-ViT/transnext.py``, TransNeXt's
``classification/transnext.py``) on the same weights, from tests/data/golden_{moh_vit,transnext}.safetensors written by
tests/make_golden.py. The loader's tests build state dicts from their parameter names and shapes, written below as
data (their code is not imported here).
"""
from __future__ import annotations

import math

import pytest
import torch
from golden import authors_router_shapes, load_golden, prefixed

from moh_lightning.layers import MoHAttention
from moh_lightning.models.transnext import (
    TransNeXt,
    TransNeXtConfig,
    authors_vit,
    checkpoint_state_dict,
    from_authors_state_dict,
)
from moh_lightning.weights import weights_path

# A tiny network in the authors' geometry (patch 4, grids 16 / 8 / 4 / 2, pooled 2x2 in stages 1-3): every router
# layout of theirs appears once. shared / routed are their shared_head / routed_head (routed_head is top-k).
TINY = {"img": 64, "dims": [8, 16, 32, 32], "heads": [2, 4, 4, 4], "depths": [1, 1, 2, 1], "mlp": [4, 4, 2, 2],
        "sr": [8, 4, 2, 1], "shared": [2, 1, 0, 2], "routed": [0, 2, 2, 1], "classes": 5}
CPB_HIDDEN = 512


def authors_shapes(spec: dict, moh: bool = True) -> dict[str, tuple]:
    """Every parameter of their (MoH-)TransNeXt: name -> shape."""
    shapes, previous = {}, 3
    for i, (dim, heads, depth, ratio, sr) in enumerate(zip(spec["dims"], spec["heads"], spec["depths"], spec["mlp"],
                                                           spec["sr"], strict=True), start=1):
        kernel = 7 if i == 1 else 3
        shapes |= {f"patch_embed{i}.proj.weight": (dim, previous, kernel, kernel), f"patch_embed{i}.proj.bias": (dim,),
                   f"patch_embed{i}.norm.weight": (dim,), f"patch_embed{i}.norm.bias": (dim,)}
        head_dim, hidden = dim // heads, int(2 * int(dim * ratio) / 3)
        for j in range(depth):
            b = f"block{i}.{j}."
            shapes |= {b + "norm1.weight": (dim,), b + "norm1.bias": (dim,),
                       b + "attn.temperature": (heads, 1, 1), b + "attn.query_embedding": (heads, 1, head_dim)}
            if sr > 1:  # AggregatedAttention
                shapes |= {b + "attn.relative_pos_bias_local": (heads, 9),
                           b + "attn.learnable_tokens": (heads, head_dim, 9), b + "attn.learnable_bias": (heads, 1, 9),
                           b + "attn.q.weight": (dim, dim), b + "attn.q.bias": (dim,),
                           b + "attn.kv.weight": (2 * dim, dim), b + "attn.kv.bias": (2 * dim,),
                           b + "attn.sr.weight": (dim, dim, 1, 1), b + "attn.sr.bias": (dim,),
                           b + "attn.norm.weight": (dim,), b + "attn.norm.bias": (dim,)}
            else:  # Attention
                shapes |= {b + "attn.qkv.weight": (3 * dim, dim), b + "attn.qkv.bias": (3 * dim,)}
            shapes |= {b + "attn.proj.weight": (dim, dim), b + "attn.proj.bias": (dim,),
                       b + "attn.cpb_fc1.weight": (CPB_HIDDEN, 2), b + "attn.cpb_fc1.bias": (CPB_HIDDEN,),
                       b + "attn.cpb_fc2.weight": (heads, CPB_HIDDEN), b + "attn.cpb_fc2.bias": (heads,)}
            if moh:
                shared, routed = spec["shared"][i - 1], spec["routed"][i - 1]
                shapes |= authors_router_shapes(b + "attn.", heads, shared, routed, dim)
            shapes |= {b + "norm2.weight": (dim,), b + "norm2.bias": (dim,), b + "mlp.fc1.weight": (2 * hidden, dim),
                       b + "mlp.fc1.bias": (2 * hidden,), b + "mlp.dwconv.dwconv.weight": (hidden, 1, 3, 3),
                       b + "mlp.dwconv.dwconv.bias": (hidden,), b + "mlp.fc2.weight": (dim, hidden),
                       b + "mlp.fc2.bias": (dim,)}
        shapes |= {f"norm{i}.weight": (dim,), f"norm{i}.bias": (dim,)}
        previous = dim
    shapes |= {"head.weight": (spec["classes"], previous), "head.bias": (spec["classes"],)}
    return shapes


def authors_state_dict(spec: dict, moh: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of their names and shapes, scaled so every term of the network matters."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in authors_shapes(spec, moh).items():
        t = torch.randn(shape, generator=g)
        if name.endswith("norm.weight") or ".norm1." in name or ".norm2." in name or name.startswith("norm"):
            t = 1 + 0.1 * t if name.endswith("weight") else 0.1 * t
        elif name.endswith("temperature"):
            t = 1.0 + 0.3 * t
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            t = t / math.sqrt(max(fan_in, 1)) if len(shape) > 1 else 0.1 * t
        state[name] = t
    return state


def suite_config(spec: dict, moh: bool = True) -> TransNeXtConfig:
    from moh_lightning.layers.moh_config import MoHConfig

    return TransNeXtConfig(img_size=spec["img"], patch_size=4, num_classes=spec["classes"], embed_dim=spec["dims"],
                           depth=spec["depths"], num_heads=spec["heads"], mlp_ratio=spec["mlp"], sr_ratio=spec["sr"],
                           drop_path_rate=0.0,
                           moh=MoHConfig(num_shared_heads=spec["shared"], top_k=spec["routed"]) if moh else None)


@pytest.mark.parametrize("name", ["moh_vit", "transnext"])
def test_their_weights_load_with_no_key_left_and_compute_their_logits(name):
    """Their own MoH-TransNeXt (SkyworkAI/MoH) and dense TransNeXt (DaiShiResearch/TransNeXt) on the same weights
    (golden files): logits in eval and train mode, the gates of every block, and their load-balance losses."""
    golden, metadata = load_golden(name)
    spec, moh = metadata["spec"], name == "moh_vit"
    model = TransNeXt(suite_config(spec, moh)).eval()
    result = model.load_state_dict(from_authors_state_dict(prefixed(golden, "weights")), strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    with torch.no_grad():
        logits = model(golden["images"])
    assert golden["logits"].abs().max() > 0.1  # the check is not vacuous
    torch.testing.assert_close(logits, golden["logits"], rtol=1e-4, atol=1e-5)
    if not moh:
        return
    layers = [m for m in model.modules() if isinstance(m, MoHAttention)]
    for i, layer in enumerate(layers):
        theirs = golden[f"gates.{i}"]
        assert torch.equal(layer.last_gates > 0, theirs > 0), f"block {i} keeps other heads"
        torch.testing.assert_close(layer.last_gates, theirs, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model.train()(golden["images"]), golden["train.logits"], rtol=1e-4, atol=1e-5)
    # Their blocks append a loss wherever heads are routed, a constant k where top-k is every routed head (no
    # gradient); the suite computes none there. MoH-ViT-B-50 meets this in its first stage (results/authors_models.md).
    theirs = golden["train.balance_losses"]
    routed = [layer for layer in layers if layer.router.num_routed_heads]
    every = [j for j, layer in enumerate(routed) if layer.router.top_k == layer.router.num_routed_heads]
    assert every and all(float(theirs[j]) == routed[j].router.top_k for j in every)
    kept = [j for j in range(len(routed)) if j not in every]
    assert all(routed[j].load_balance_loss is None for j in every)
    torch.testing.assert_close(torch.stack([routed[j].load_balance_loss for j in kept]), theirs[kept], rtol=1e-5,
                               atol=1e-6)


def test_authors_checkpoint_file_and_hub_id_load_through_the_loader(tmp_path, monkeypatch):
    state = authors_state_dict(TINY)
    import argparse

    # Their main.py saves {"model", "optimizer", ..., "args": Namespace}; the released files hold "model".
    path = tmp_path / "moh_tiny.pth"
    torch.save({"model": state, "epoch": 299, "args": argparse.Namespace(model="tiny")}, path)
    assert checkpoint_state_dict(torch.load(path, weights_only=False)).keys() == \
        from_authors_state_dict(state).keys()

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo: ["README.md", "moh_tiny.pth"])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, filename: str(tmp_path / filename))
    assert weights_path("Chat-UniVi/MoH-ViT-S-75", "pretrained") == path
    model = authors_vit("someone/tiny", model="moh_transnext_micro_75", **_tiny_overrides())
    expected = TransNeXt(suite_config(TINY)).eval()
    expected.load_state_dict(from_authors_state_dict(state))
    images = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(model(images), expected(images))


def _tiny_overrides() -> dict:
    from dataclasses import asdict

    fields = asdict(suite_config(TINY))
    return {key: fields[key] for key in ("img_size", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio",
                                         "sr_ratio", "moh")}


def test_loader_names_what_does_not_fit(tmp_path, monkeypatch):
    state = authors_state_dict(TINY)
    del state["block3.1.attn.wg.weight"]
    state["block3.1.attn.extra"] = torch.zeros(1)
    torch.save({"model": state}, tmp_path / "broken.pth")
    with pytest.raises(ValueError, match=r"1 missing \['stages.2.blocks.1.attn.router.routed_router.weight'\], "
                                         r"1 unexpected \['stages.2.blocks.1.attn.extra'\]"):
        authors_vit(tmp_path / "broken.pth", model="moh_transnext_micro_75", **_tiny_overrides())

    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", offline)
    with pytest.raises(FileNotFoundError, match="download the weights file and give its path"):
        weights_path("Chat-UniVi/MoH-ViT-B-50", "pretrained")


def test_moh_validate_with_the_authors_weights_reports_top1(tmp_path, run_dir, write_image_folder):
    """`moh validate --config moh_transnext_small_75.yaml --model.init_args.init_from <their file>` at tiny size."""
    write_image_folder(tmp_path / "imagenet", per_class=2, size=(64, 64))
    spec = {**TINY, "classes": 2}
    torch.save({"model": authors_state_dict(spec)}, tmp_path / "theirs.pth")
    fields = _tiny_overrides()
    arch = [f"--model.init_args.arch.{key}={value}" for key, value in fields.items()
            if key not in ("moh", "num_classes")]
    from moh_lightning.trainer_cli import MoHLightningCLI

    cli = MoHLightningCLI(args=[
        "validate", "--config", "moh_transnext_small_75.yaml", *arch, "--model.init_args.arch.num_classes=2",
        f"--model.init_args.arch.moh.num_shared_heads={TINY['shared']}",
        f"--model.init_args.arch.moh.top_k={TINY['routed']}",
        f"--model.init_args.init_from={tmp_path / 'theirs.pth'}", f"--data.init_args.data_dir={tmp_path / 'imagenet'}",
        "--data.init_args.img_size=64", "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
        "--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.logger=false"])
    assert 0.0 <= float(cli.trainer.callback_metrics["val/acc1"]) <= 1.0
    loaded = TransNeXt(suite_config(spec))
    loaded.load_state_dict(from_authors_state_dict(authors_state_dict(spec)))
    pairs = zip(cli.model.model.state_dict().values(), loaded.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
