"""The authors' released MoH-ViT (TransNeXt) checkpoints load into the suite's TransNeXt and compute their function.

Their code is not imported: the state dicts are built here from their parameter names and shapes (read off SkyworkAI/MoH
``MoH-ViT/transnext.py``, ``attention.py``, ``attention_native.py``, written down below as data), and the loaded models
are checked against a re-computation of TransNeXt with MoH written from the formulas, on those tensors under those
names. (The comparison with their own code on the same weights is in results/authors_models.md.)
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moh_lightning.models.transnext import (
    TransNeXt,
    TransNeXtConfig,
    checkpoint_state_dict,
    from_authors_state_dict,
    weights_file,
)
from moh_lightning.tools.authors_models import authors_vit

# A tiny network in the authors' geometry (patch 4, grids 16 / 8 / 4 / 2, pooled 2x2 in stages 1-3): every router
# layout of theirs appears once. shared / routed are their shared_head / routed_head (routed_head is top-k).
TINY = {"img": 64, "dims": [8, 16, 32, 32], "heads": [2, 4, 4, 4], "depths": [1, 1, 2, 1], "mlp": [4, 4, 2, 2],
        "sr": [8, 4, 2, 1], "shared": [2, 1, 0, 2], "routed": [0, 2, 2, 1], "classes": 5}
CPB_HIDDEN = 512


def authors_shapes(spec: dict, moh: bool = True) -> dict[str, tuple]:
    """Every parameter of their (MoH-)TransNeXt: name -> shape."""
    shapes, previous = {}, 3
    for i, (dim, heads, depth, ratio, sr) in enumerate(zip(spec["dims"], spec["heads"], spec["depths"], spec["mlp"],
                                                           spec["sr"]), start=1):
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
                if routed > 0:
                    shapes[b + "attn.wg.weight"] = (heads - shared, dim)
                    if shared > 0:
                        shapes[b + "attn.wg_0.weight"] = (2, dim)
                if shared > 1:
                    shapes[b + "attn.wg_1.weight"] = (shared, dim)
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


# ---- TransNeXt with MoH, re-computed from the formulas on their tensors (loops and explicit index maps) ----------

def _layer_norm(x, sd, prefix, eps):
    return F.layer_norm(x, x.shape[-1:], sd[prefix + ".weight"], sd[prefix + ".bias"], eps)


def _linear(x, sd, prefix):
    return x @ sd[prefix + ".weight"].t() + sd[prefix + ".bias"]


def _gates(x, sd, b, heads, shared, routed):
    """Per-token head gates of MoH's two-stage router, or None for multi-head attention."""
    if b + "wg.weight" not in sd and b + "wg_1.weight" not in sd:
        return None
    parts = []
    if shared:
        parts.append(torch.softmax(x @ sd[b + "wg_1.weight"].t(), -1) * shared if shared > 1
                     else torch.ones(*x.shape[:-1], 1))
    if routed:
        scores = torch.softmax(x @ sd[b + "wg.weight"].t(), -1)
        top = torch.zeros_like(scores).scatter(-1, scores.topk(routed, -1).indices, 1.0)
        kept = scores * top
        parts.append(kept / kept.sum(-1, keepdim=True) * routed)
    if shared and routed:
        alpha = torch.softmax(x @ sd[b + "wg_0.weight"].t(), -1) * 2
        parts = [parts[0] * alpha[..., :1], parts[1] * alpha[..., 1:]]
    return torch.cat(parts, -1)                                                    # (B, N, h)


def _position_bias(sd, b, grid, key_grid, pretrain_grid):
    """(h, N, M): the CPB MLP applied to every (query, pooled key) offset, no table."""
    axis = torch.arange(grid, dtype=torch.float32)
    # Pooled key c averages the positions of adaptive pooling's bin [floor(c G / K), ceil((c + 1) G / K)).
    centres = torch.stack([axis[c * grid // key_grid: -(-(c + 1) * grid // key_grid)].mean() for c in range(key_grid)])
    qy, qx = torch.meshgrid(axis, axis, indexing="ij")
    ky, kx = torch.meshgrid(centres, centres, indexing="ij")
    dy = (qy.reshape(-1, 1) - ky.reshape(1, -1)) / (pretrain_grid - 1) * 8
    dx = (qx.reshape(-1, 1) - kx.reshape(1, -1)) / (pretrain_grid - 1) * 8
    offsets = torch.stack([dy, dx], -1)
    offsets = torch.sign(offsets) * torch.log2(offsets.abs() + 1) / math.log2(8)
    hidden = torch.relu(_linear(offsets, sd, b + "cpb_fc1"))
    return _linear(hidden, sd, b + "cpb_fc2").permute(2, 0, 1)


def _attention(x, sd, b, grid, heads, sr, shared, routed):
    batch, length, dim = x.shape
    d = dim // heads
    unit = lambda t: t / t.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # noqa: E731
    split = lambda t: t.reshape(batch, length, heads, d).transpose(1, 2)  # noqa: E731
    temperature = F.softplus(sd[b + "temperature"])
    if sr == 1:
        q, k, v = _linear(x, sd, b + "qkv").chunk(3, -1)
        q, k, v = split(q), split(k), split(v)
        scale = math.log(length)
        scores = ((unit(q) + sd[b + "query_embedding"]) * temperature * scale) @ unit(k).transpose(-2, -1)
        out = torch.softmax(scores + _position_bias(sd, b, grid, grid, grid), -1) @ v
    else:
        q = split(_linear(x, sd, b + "q"))
        k, v = _linear(x, sd, b + "kv").chunk(2, -1)
        k, v = unit(split(k)), split(v)
        key_grid = grid // sr
        # Window of each token as explicit (N, 9) indices, row by row, and whether each lies on the map.
        ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
        dys, dxs = torch.meshgrid(torch.arange(-1, 2), torch.arange(-1, 2), indexing="ij")
        ny, nx = ys.reshape(-1, 1) + dys.reshape(1, -1), xs.reshape(-1, 1) + dxs.reshape(1, -1)
        inside = (ny >= 0) & (ny < grid) & (nx >= 0) & (nx < grid)
        index = (ny.clamp(0, grid - 1) * grid + nx.clamp(0, grid - 1))                  # (N, 9)
        scale = torch.log(inside.sum(-1, keepdim=True).float() + key_grid ** 2)        # (N, 1)
        qs = (unit(q) + sd[b + "query_embedding"]) * temperature * scale               # (B, h, N, d)
        k_win, v_win = k[:, :, index], v[:, :, index] * inside[..., None]              # (B, h, N, 9, d)
        local = (qs[:, :, :, None] * k_win).sum(-1) + sd[b + "relative_pos_bias_local"][:, None]
        local = local.masked_fill(~inside, float("-inf"))
        feature = x.transpose(1, 2).reshape(batch, dim, grid, grid)
        feature = F.gelu(F.conv2d(feature, sd[b + "sr.weight"], sd[b + "sr.bias"]))
        pooled = F.adaptive_avg_pool2d(feature, key_grid).flatten(2).transpose(1, 2)
        pooled = _layer_norm(pooled, sd, b + "norm", 1e-5)
        kp, vp = _linear(pooled, sd, b + "kv").chunk(2, -1)
        kp = kp.reshape(batch, -1, heads, d).transpose(1, 2)
        vp = vp.reshape(batch, -1, heads, d).transpose(1, 2)
        pool = qs @ unit(kp).transpose(-2, -1) + _position_bias(sd, b, grid, key_grid, grid)
        weights = torch.softmax(torch.cat([local, pool], -1), -1)
        w_local, w_pool = weights[..., :9], weights[..., 9:]
        w_local = w_local + unit(q) @ sd[b + "learnable_tokens"] + sd[b + "learnable_bias"]
        out = (w_local[..., None] * v_win).sum(-2) + w_pool @ vp
    out = out.transpose(1, 2)                                                       # (B, N, h, d)
    gates = _gates(x, sd, b, heads, shared, routed)
    if gates is not None:
        out = out * gates[..., None]
    return _linear(out.reshape(batch, length, dim), sd, b + "proj")


def reference_logits(sd: dict, spec: dict, images: torch.Tensor) -> torch.Tensor:
    x = images
    for i in range(4):
        p = f"patch_embed{i + 1}"
        stride = 4 if i == 0 else 2
        x = F.conv2d(x, sd[p + ".proj.weight"], sd[p + ".proj.bias"], stride=stride,
                     padding=sd[p + ".proj.weight"].shape[-1] // 2)
        batch, dim, grid, _ = x.shape
        t = _layer_norm(x.flatten(2).transpose(1, 2), sd, p + ".norm", 1e-5)
        for j in range(spec["depths"][i]):
            b = f"block{i + 1}.{j}."
            t = t + _attention(_layer_norm(t, sd, b + "norm1", 1e-6), sd, b + "attn.", grid, spec["heads"][i],
                               spec["sr"][i], spec["shared"][i], spec["routed"][i])
            gate, value = _linear(_layer_norm(t, sd, b + "norm2", 1e-6), sd, b + "mlp.fc1").chunk(2, -1)
            hidden = gate.shape[-1]
            gate = F.conv2d(gate.transpose(1, 2).reshape(batch, hidden, grid, grid), sd[b + "mlp.dwconv.dwconv.weight"],
                            sd[b + "mlp.dwconv.dwconv.bias"], padding=1, groups=hidden).flatten(2).transpose(1, 2)
            t = t + _linear(F.gelu(gate) * value, sd, b + "mlp.fc2")
        t = _layer_norm(t, sd, f"norm{i + 1}", 1e-6)
        x = t.transpose(1, 2).reshape(batch, dim, grid, grid)
    return _linear(x.mean((2, 3)), sd, "head")


@pytest.mark.parametrize("moh", [True, False], ids=["moh", "dense"])
def test_authors_state_dict_loads_with_no_key_left_and_matches_the_recomputation(moh):
    state = authors_state_dict(TINY, moh)
    model = TransNeXt(suite_config(TINY, moh)).eval()
    result = model.load_state_dict(from_authors_state_dict(state), strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    images = torch.randn(2, 3, TINY["img"], TINY["img"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, reference = model(images), reference_logits(state, TINY, images)
    assert reference.abs().max() > 0.1  # the check is not vacuous
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


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
    assert weights_file("Chat-UniVi/MoH-ViT-S-75") == path
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
    with pytest.raises(ValueError, match=r"1 missing weights \(stages.2.blocks.1.attn.router.routed_router.weight\), "
                                         r"1 unexpected \(stages.2.blocks.1.attn.extra\)"):
        authors_vit(tmp_path / "broken.pth", model="moh_transnext_micro_75", **_tiny_overrides())

    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", offline)
    with pytest.raises(FileNotFoundError, match="download the checkpoint file and give its path"):
        weights_file("Chat-UniVi/MoH-ViT-B-50")


def test_moh_validate_with_the_authors_weights_reports_top1(tmp_path, run_dir, write_image_folder):
    """`moh validate --config moh_transnext_small_75.yaml --model.init_args.pretrained <their file>` at tiny size."""
    write_image_folder(tmp_path / "imagenet", per_class=2, size=(64, 64))
    spec = {**TINY, "classes": 2}
    torch.save({"model": authors_state_dict(spec)}, tmp_path / "theirs.pth")
    fields = _tiny_overrides()
    arch = [f"--model.init_args.arch.{key}={value}" for key, value in fields.items()
            if key not in ("moh", "num_classes")]
    from moh_lightning.cli import MoHLightningCLI

    cli = MoHLightningCLI(args=[
        "validate", "--config", "moh_transnext_small_75.yaml", *arch, "--model.init_args.arch.num_classes=2",
        f"--model.init_args.arch.moh.num_shared_heads={TINY['shared']}",
        f"--model.init_args.arch.moh.top_k={TINY['routed']}",
        f"--model.init_args.pretrained={tmp_path / 'theirs.pth'}", f"--data.init_args.data_dir={tmp_path / 'imagenet'}",
        "--data.init_args.img_size=64", "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
        "--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.logger=false"])
    assert 0.0 <= float(cli.trainer.callback_metrics["val/acc1"]) <= 1.0
    loaded = TransNeXt(suite_config(spec))
    loaded.load_state_dict(from_authors_state_dict(authors_state_dict(spec)))
    assert all(torch.equal(a, b) for a, b in zip(cli.model.model.state_dict().values(), loaded.state_dict().values()))
