"""timm's model contract for every model the suite registers, checked as timm's tests/test_models.py checks its own.

Each model is built tiny (a few pixels, narrow heads, three ViT blocks, one block per TransNeXt stage) with its own
head budget, so the whole registry runs in seconds on a CPU.
"""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import timm
import torch
from timm.models import create_feature_extractor

from moh_lightning.layers import MoHAttention, pop_load_balance_loss
from moh_lightning.models import transnext, vit

MODULES = [module.__name__.rsplit(".", 1)[-1] for module in (vit, transnext)]
NAMES = timm.list_models(module=MODULES)
# The tracing tests (fx, export, TorchScript) take seconds a model (a TransNeXt's export up to 8), so they trace one
# model per code path, every model being built tiny: a MoH-ViT with a budget per layer (top-k changes from block to
# block; S-80's too) and one with one budget for every layer (B-50's and the generic one's too); a dense TransNeXt
# (its three sizes run the same code); a MoH-TransNeXt whose first two stages share every head (S-80, S-75, B-75 and
# the generic one too: the same layers with other counts), and B-50, whose routers reach every stage.
TRACED_NAMES = ["moh_vit_small_patch16_224_75", "moh_vit_base_patch16_224_75", "transnext_micro",
                "moh_transnext_micro_75", "moh_transnext_base_50"]
# The fast subset keeps one model per family.
FAST = {"moh_vit_small_patch16_224_75", "moh_transnext_micro_75", "transnext_micro"}
TRACED = [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in TRACED_NAMES]


def _tiny(name: str) -> tuple[dict, int]:
    """Overrides that keep the named model's heads and budget at a few pixels, and the input side they give."""
    if name in vit.NAMED_VITS:
        config = vit.named_vit_config(name)
        # Three blocks, the last three that features_only returns; a per-layer budget keeps its first, middle and
        # last layers' top-k, so a change of top-k between blocks is still traced.
        top_k = config.moh.top_k
        moh = {**dataclasses.asdict(config.moh),
               "top_k": [top_k[0], top_k[len(top_k) // 2], top_k[-1]] if isinstance(top_k, list) else top_k}
        return {"img_size": 32, "embed_dim": 8 * config.num_heads, "depth": 3, "moh": moh}, 32
    heads = transnext.transnext_config(name).stage("num_heads")
    return {"img_size": 64, "depth": 1, "embed_dim": [8 * h for h in heads]}, 64


def _create(name: str, seed: int = 0, **kwargs) -> tuple[torch.nn.Module, torch.Tensor]:
    """The tiny model (weights from ``seed``) and a batch of two inputs for it."""
    overrides, size = _tiny(name)
    torch.manual_seed(seed)
    model = timm.create_model(name, **overrides, **kwargs)
    return model, torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed + 1))


def test_every_named_model_is_registered_with_timm():
    assert set(NAMES) == set(vit.NAMED_VITS) | set(transnext.NAMED_MODELS)
    assert set(TRACED_NAMES) <= set(NAMES)


@pytest.mark.slow
def test_importing_the_models_registers_them():
    code = ("import moh_lightning.models, timm; timm.create_model('moh_vit_small_patch16_224_75', img_size=32, "
            "embed_dim=48); "
            f"print(sorted(timm.list_models(module={MODULES!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(NAMES))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_default_cfg(name):
    model, x = _create(name)
    cfg = model.pretrained_cfg
    assert cfg["architecture"] == name and cfg["num_classes"] == model.num_classes
    assert len(cfg["input_size"]) == 3 and len(cfg["mean"]) == len(cfg["std"]) == cfg["input_size"][0]
    state = model.state_dict()
    assert f"{cfg['classifier']}.weight" in state and f"{cfg['first_conv']}.weight" in state
    features = model.eval().forward_features(x)
    if cfg.get("pool_size"):  # the last map at the default input size (hierarchical models)
        reduction = model.feature_info[-1]["reduction"]
        assert tuple(side // reduction for side in cfg["input_size"][1:]) == cfg["pool_size"]
        assert features.shape[-2:] == tuple(side // reduction for side in x.shape[-2:])
    model.reset_classifier(0)
    assert model(x).shape == (2, model.num_features)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_forward_and_backward(name):
    model, x = _create(name, num_classes=7)
    out = model.train()(x)
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    loss = out.mean()
    balance = pop_load_balance_loss(model)
    assert (balance is None) == (not name.startswith("moh"))
    (loss if balance is None else loss + balance).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_features_only_match_forward_intermediates(name):
    features, x = _create(name, features_only=True)
    info = features.feature_info
    outputs = features.eval()(x)
    assert len(outputs) == len(info.channels()) == len(info.out_indices)
    for out, channels, reduction in zip(outputs, info.channels(), info.reduction(), strict=True):
        assert out.shape[:2] == (2, channels)
        assert all(side <= math.ceil(x.shape[-1] / reduction) + 1 for side in out.shape[-2:])

    model, _ = _create(name)  # same seed: the weights the features were pruned from
    final, intermediates = model.eval().forward_intermediates(x, indices=list(info.out_indices))
    torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
    for out, intermediate in zip(outputs, intermediates, strict=True):
        torch.testing.assert_close(out, intermediate, rtol=0, atol=0)
    early = model.forward_intermediates(x, indices=list(info.out_indices), stop_early=True, intermediates_only=True)
    for out, intermediate in zip(outputs, early, strict=True):
        torch.testing.assert_close(out, intermediate, rtol=0, atol=0)


@pytest.mark.parametrize("name", TRACED)
@pytest.mark.slow
def test_fx_forward_and_backward(name):
    model, x = _create(name, num_classes=7)
    graph = create_feature_extractor(model, {model.pretrained_cfg["classifier"]: "logits"})
    # The trace leaves no proxies behind in the layers' recorded state.
    assert all(layer.last_gates is None for layer in model.modules() if isinstance(layer, MoHAttention))
    with torch.no_grad():
        torch.testing.assert_close(graph.eval()(x)["logits"], model.eval()(x), rtol=0, atol=0)
    out = graph.train()(x)["logits"]
    assert out.shape == (2, 7)
    out.mean().backward()
    assert [n for n, p in graph.named_parameters() if p.grad is None] == []

    fx_features, _ = _create(name, features_only=True, feature_cls="fx")
    getter_features, _ = _create(name, features_only=True)
    for traced, getter in zip(fx_features.eval()(x), getter_features.eval()(x), strict=True):
        if traced.ndim == 3:  # timm's FX graph of a ViT gives its tokens (B, N, C), the getter NCHW maps
            traced = traced[:, -getter.shape[-2] * getter.shape[-1]:].transpose(1, 2).reshape(getter.shape)
        torch.testing.assert_close(traced, getter, rtol=0, atol=0)


@pytest.mark.parametrize("name", TRACED)
@pytest.mark.slow
def test_torch_export(name):
    model, x = _create(name)
    model.eval()
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(x), model(x))


# Not TorchScript, where timm's own ViTs are (vit_small_patch16_224 scripts under torch 2.14): TorchScript compiles
# every forward a model reaches, and MoHAttention's cannot be. The learned router's gates come out of a custom
# autograd function (its hand-written backward), and TorchScript cannot call Function.apply; the block's forward takes
# a Python callable (rotary embedding) and a KV cache object. The dense TransNeXt baselines share TransNeXt's attention
# classes, which use Python TorchScript does not take (the first failure: unpacking a tensor). torch 2.14 deprecates
# torch.jit.script in favour of torch.export, which runs every model here (test_torch_export).
TORCHSCRIPT = ("MoHAttention is not TorchScript (its router's custom autograd function, its callable and KV cache "
               "arguments); use torch.export")


@pytest.mark.parametrize("name", TRACED)
@pytest.mark.xfail(raises=(RuntimeError, ValueError, torch.jit.frontend.NotSupportedError), strict=True,
                   reason=TORCHSCRIPT)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript(name):
    with timm.set_scriptable(True):
        model, x = _create(name)
    scripted = torch.jit.script(model.eval())
    torch.testing.assert_close(scripted(x), model(x))
