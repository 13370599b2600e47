"""The authors' MoH-DiT (SkyworkAI/MoH ``MoH-DiT/models.py``) loaded into the suite's DiT: every key used, and the
loaded model computes their function, checked against a re-computation written here from their formulas.

Their code is never imported: the parameter names and shapes below are written as data, read off their modules
(``DiT``, ``DiTBlock``, ``MoHAttention``, ``FinalLayer``, timm's ``PatchEmbed`` / ``Mlp``).
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moh_lightning.cli import main as moh
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.dit import DiT, DiTConfig
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion
from moh_lightning.tools.authors_dit import (
    authors_to_dit_state_dict,
    experiment_init_args,
    load_authors_dit,
    read_state_dict,
)

# A tiny MoH-DiT in their parametrisation: per block heads h, shared_head h_s and routed_head (their k). Block 0/1:
# every head shared (wg_1 only, as XL/2-90's first 19 blocks); block 2: shared + routed (wg, wg_0, wg_1); block 3:
# routed only (wg).
TINY = {"input_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 48, "num_classes": 5, "head_dim": 8,
        "num_heads": [2, 4, 6, 6], "shared_head": [2, 4, 4, 0], "routed_head": [0, 0, 1, 2]}
# Their MoH_DiT_XL_2_90 (models.py), on ImageNet 256 latents.
XL_2_90 = {"input_size": 32, "patch_size": 2, "in_channels": 4, "hidden_size": 1152, "num_classes": 1000,
           "head_dim": 72, "num_heads": [8] * 9 + [16] * 10 + [24] * 9, "shared_head": [8] * 9 + [16] * 19,
           "routed_head": [0] * 19 + [3] * 9}


def authors_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter of their DiT(moh=True) with its shape (mlp_ratio 4, learned sigma, label dropout > 0)."""
    dim, p, channels, d = m["hidden_size"], m["patch_size"], m["in_channels"], m["head_dim"]
    out_width = p * p * 2 * channels
    shapes = {"pos_embed": (1, (m["input_size"] // p) ** 2, dim),
              "x_embedder.proj.weight": (dim, channels, p, p), "x_embedder.proj.bias": (dim,),
              "t_embedder.mlp.0.weight": (dim, 256), "t_embedder.mlp.0.bias": (dim,),
              "t_embedder.mlp.2.weight": (dim, dim), "t_embedder.mlp.2.bias": (dim,),
              "y_embedder.embedding_table.weight": (m["num_classes"] + 1, dim)}
    for i, (h, shared, routed) in enumerate(zip(m["num_heads"], m["shared_head"], m["routed_head"])):
        b = f"blocks.{i}."
        shapes.update({b + "attn.qkv.weight": (3 * h * d, dim), b + "attn.qkv.bias": (3 * h * d,),
                       b + "attn.proj.weight": (dim, h * d), b + "attn.proj.bias": (dim,),
                       b + "mlp.fc1.weight": (4 * dim, dim), b + "mlp.fc1.bias": (4 * dim,),
                       b + "mlp.fc2.weight": (dim, 4 * dim), b + "mlp.fc2.bias": (dim,),
                       b + "adaLN_modulation.1.weight": (6 * dim, dim), b + "adaLN_modulation.1.bias": (6 * dim,)})
        if routed > 0:
            shapes[b + "attn.wg.weight"] = (h - shared, dim)
            if shared > 0:
                shapes[b + "attn.wg_0.weight"] = (2, dim)
        if shared > 1:
            shapes[b + "attn.wg_1.weight"] = (shared, dim)
    shapes.update({"final_layer.linear.weight": (out_width, dim), "final_layer.linear.bias": (out_width,),
                   "final_layer.adaLN_modulation.1.weight": (2 * dim, dim),
                   "final_layer.adaLN_modulation.1.bias": (2 * dim,)})
    return shapes


def mae_sincos(dim: int, grid: int) -> np.ndarray:
    """MAE's 2-D sin-cos table in numpy (their get_2d_sincos_pos_embed): w coordinate first, then h."""
    w, h = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32))
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))

    def one(pos):
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([one(w), one(h)], axis=1)


def authors_state(m: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under their names; adaLN and output layers non-zero, routers of unit-variance logits."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in authors_shapes(m).items():
        scale = shape[1] ** -0.5 if len(shape) >= 2 else 0.02
        if len(shape) == 4:
            scale = math.prod(shape[1:]) ** -0.5
        state[name] = torch.randn(shape, generator=generator) * scale
    grid = m["input_size"] // m["patch_size"]
    state["pos_embed"] = torch.from_numpy(mae_sincos(m["hidden_size"], grid)).float()[None]
    return state


def tiny_config() -> DiTConfig:
    return DiTConfig(input_size=8, patch_size=2, in_channels=4, embed_dim=48, depth=4, num_heads=TINY["num_heads"],
                     head_dim=8, num_classes=5, moh=MoHConfig(num_shared_heads=TINY["shared_head"],
                                                              top_k=TINY["routed_head"]))


def their_attention(w: dict, b: str, x: torch.Tensor, h: int, shared: int, routed: int, d: int):
    """Their MoHAttention.forward (eval) from its formulas: returns the output and the gates (B, N, h)."""
    batch, tokens, _ = x.shape
    q, k, v = F.linear(x, w[b + "qkv.weight"], w[b + "qkv.bias"]).reshape(batch, tokens, 3, h, d).permute(2, 0, 3, 1, 4)
    heads = ((q @ k.transpose(-2, -1)) / math.sqrt(d)).softmax(-1) @ v                 # (B, h, N, d)
    if shared > 1:
        shared_gates = (x @ w[b + "wg_1.weight"].T).softmax(-1) * shared
    else:
        shared_gates = x.new_ones(batch, tokens, shared)
    if routed > 0:
        probs = (x @ w[b + "wg.weight"].T).softmax(-1)
        mask = F.one_hot(probs.topk(routed, dim=-1).indices, probs.shape[-1]).sum(-2)
        kept = probs * mask
        routed_gates = kept / kept.sum(-1, keepdim=True).clamp(min=torch.finfo(kept.dtype).eps) * routed
        if shared > 0:
            balance = (x @ w[b + "wg_0.weight"].T).softmax(-1) * 2
            gates = torch.cat([shared_gates * balance[..., :1], routed_gates * balance[..., 1:]], -1)
        else:
            gates = routed_gates
    else:
        gates = shared_gates
    out = (heads.transpose(1, 2) * gates[..., None]).reshape(batch, tokens, h * d)
    return F.linear(out, w[b + "proj.weight"], w[b + "proj.bias"]), gates


def their_dit(w: dict, m: dict, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor):
    """Their DiT.forward (eval) from its formulas: the output (B, 2C, H, W) and each block's gates."""
    p, dim = m["patch_size"], m["hidden_size"]
    modulate = lambda z, shift, scale: z * (1 + scale[:, None]) + shift[:, None]  # noqa: E731
    norm = lambda z: F.layer_norm(z, (dim,), eps=1e-6)  # noqa: E731
    tokens = F.conv2d(x, w["x_embedder.proj.weight"], w["x_embedder.proj.bias"], stride=p).flatten(2).transpose(1, 2)
    tokens = tokens + w["pos_embed"]
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    args = t[:, None].float() * freqs[None]
    t_emb = torch.cat([torch.cos(args), torch.sin(args)], -1)
    t_emb = F.linear(F.silu(F.linear(t_emb, w["t_embedder.mlp.0.weight"], w["t_embedder.mlp.0.bias"])),
                     w["t_embedder.mlp.2.weight"], w["t_embedder.mlp.2.bias"])
    c = t_emb + w["y_embedder.embedding_table.weight"][y]
    all_gates = []
    for i, (h, shared, routed) in enumerate(zip(m["num_heads"], m["shared_head"], m["routed_head"])):
        b = f"blocks.{i}."
        mod = F.linear(F.silu(c), w[b + "adaLN_modulation.1.weight"], w[b + "adaLN_modulation.1.bias"]).chunk(6, 1)
        attn, gates = their_attention(w, b + "attn.", modulate(norm(tokens), mod[0], mod[1]), h, shared, routed,
                                      m["head_dim"])
        all_gates.append(gates)
        tokens = tokens + mod[2][:, None] * attn
        hidden = F.gelu(F.linear(modulate(norm(tokens), mod[3], mod[4]), w[b + "mlp.fc1.weight"],
                                 w[b + "mlp.fc1.bias"]), approximate="tanh")
        tokens = tokens + mod[5][:, None] * F.linear(hidden, w[b + "mlp.fc2.weight"], w[b + "mlp.fc2.bias"])
    shift, scale = F.linear(F.silu(c), w["final_layer.adaLN_modulation.1.weight"],
                            w["final_layer.adaLN_modulation.1.bias"]).chunk(2, 1)
    out = F.linear(modulate(norm(tokens), shift, scale), w["final_layer.linear.weight"], w["final_layer.linear.bias"])
    grid, channels = m["input_size"] // p, 2 * m["in_channels"]
    out = torch.einsum("nhwpqc->nchpwq", out.reshape(-1, grid, grid, p, p, channels))
    return out.reshape(-1, channels, grid * p, grid * p), all_gates


def test_their_state_dict_loads_completely_and_computes_their_function():
    state = authors_state(TINY)
    model = load_authors_dit(state, tiny_config())  # raises on any missing or unexpected key
    assert len(model.state_dict()) == len(state) - 1  # everything but their pos_embed parameter
    assert model.blocks[2].attn.router.type_router is not None and model.blocks[0].attn.router.routed_router is None
    torch.manual_seed(1)
    x, t, y = torch.randn(3, 4, 8, 8), torch.tensor([3, 500, 999]), torch.tensor([0, 4, 2])
    with torch.no_grad():
        ours = model(x, t, y)
        expected, gates = their_dit(state, TINY, x, t, y)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    for block, theirs in zip(model.blocks, gates):
        torch.testing.assert_close(block.attn.last_gates, theirs, atol=1e-6, rtol=1e-5)
    routed = gates[2][..., 4:]
    assert (routed > 0).sum(-1).eq(1).all() and len({int(i) for i in routed.argmax(-1).flatten()}) == 2

    # Their forward_with_cfg guides 3 of the 4 latent channels: the suite's channels=3.
    with torch.no_grad():
        guided = model.forward_with_cfg(x, t, y, 4.0, channels=3)
        null, _ = their_dit(state, TINY, x, t, torch.full_like(y, 5))
    eps = null[:, :3] + 4.0 * (expected[:, :3] - null[:, :3])
    torch.testing.assert_close(guided, torch.cat([eps, expected[:, 3:]], 1), atol=1e-5, rtol=1e-5)


def test_dit_xl2_90_config_is_their_xl_2_90_key_for_key():
    arch = DiTConfig(**experiment_init_args("dit_xl2_90.yaml")["model"]["init_args"]["arch"])
    with torch.device("meta"):
        ours = {name: tuple(value.shape) for name, value in DiT(arch).state_dict().items()}
    theirs = authors_shapes(XL_2_90)
    state = {name: torch.empty(shape, device="meta") for name, shape in theirs.items() if name != "pos_embed"}
    mapped = {name: tuple(value.shape) for name, value in authors_to_dit_state_dict(state, arch).items()}
    assert mapped == ours
    assert round(arch.activated_fraction, 4) == round((9 * 8 + 10 * 16 + 9 * 19) / (9 * 8 + 10 * 16 + 9 * 24), 4)


def test_sources_train_py_checkpoint_and_hub(tmp_path, monkeypatch):
    state = authors_state(TINY)
    # train.py's checkpoint: the model, its EMA, the optimiser and the argparse namespace; the EMA is the one sampled.
    torch.save({"model": {k: v * 0 for k, v in state.items()}, "ema": state, "opt": {},
                "args": argparse.Namespace(model="MoH-DiT-XL/2-90")}, tmp_path / "0400000.pt")
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "ddp.pt")
    for name in ("0400000.pt", "ddp.pt"):
        loaded = read_state_dict(str(tmp_path / name))
        assert loaded.keys() == state.keys() and torch.equal(loaded["blocks.2.attn.wg.weight"],
                                                             state["blocks.2.attn.wg.weight"])

    import huggingface_hub

    listed = {"someone/moh-dit": ["README.md", "MoH-DiT-XL-2-90.pt"], "someone/two": ["a.pt", "b.safetensors"]}
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id: listed[repo_id])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename: str(tmp_path / "0400000.pt"))
    assert read_state_dict("someone/moh-dit").keys() == state.keys()
    assert read_state_dict("someone/two/a.pt").keys() == state.keys()
    with pytest.raises(ValueError, match="holds 2 weight files"):
        read_state_dict("someone/two")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_state_dict(str(tmp_path / "absent.pt"))


def test_mismatches_name_the_keys():
    state = authors_state(TINY)
    wrong_budget = DiTConfig(**{**tiny_config().__dict__, "moh": MoHConfig(num_shared_heads=[2, 4, 6, 0],
                                                                           top_k=[0, 0, 0, 2])})
    with pytest.raises(ValueError, match=r"unexpected \['blocks.2.attn.router.routed_router.weight'"):
        load_authors_dit(state, wrong_budget)
    moved = {**state, "pos_embed": state["pos_embed"] + 0.1}
    with pytest.raises(ValueError, match="pos_embed differs"):
        load_authors_dit(moved, tiny_config())


def test_load_authors_dit_writes_a_checkpoint_moh_sample_reads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save(authors_state(TINY), tmp_path / "authors.pt")
    arch = {"input_size": 8, "patch_size": 2, "in_channels": 4, "embed_dim": 48, "depth": 4,
            "num_heads": TINY["num_heads"], "head_dim": 8, "num_classes": 5,
            "moh": {"num_shared_heads": TINY["shared_head"], "top_k": TINY["routed_head"]}}
    (tmp_path / "tiny_latent.yaml").write_text(json.dumps({  # JSON is YAML; no data section: no VAE to decode
        "model": {"class_path": "moh_lightning.tasks.ClassConditionalDiffusion", "init_args": {"arch": arch}}}))
    moh(["load-authors-dit", "--source", "authors.pt", "--experiment", "tiny_latent.yaml", "--out", "authors.ckpt"])

    task = ClassConditionalDiffusion.load_from_checkpoint("authors.ckpt", map_location="cpu", weights_only=False)
    assert (task.hparams.cfg_scale, task.hparams.cfg_channels, task.hparams.sampler,
            task.hparams.sample_steps) == (1.5, 3, "ddpm", 250)  # their FID protocol (sample_ddp.py)
    direct = load_authors_dit(str(tmp_path / "authors.pt"), tiny_config())
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10, 900]), torch.tensor([1, 3])
    with torch.no_grad():
        torch.testing.assert_close(task.eval().model(x, t, y), direct(x, t, y), atol=0, rtol=0)

    moh(["sample", "--checkpoint", "authors.ckpt", "--out_dir", "samples", "--num_samples", "2", "--steps", "2",
         "--classes", "[1, 3]"])
    samples = np.load(tmp_path / "samples" / "samples.npz")
    assert samples["arr_0"].shape[:3] == (2, 8, 8) and samples["arr_1"].tolist() == [1, 3]
    assert json.loads((tmp_path / "samples" / "sample_args.json").read_text())["cfg_scale"] == 1.5
