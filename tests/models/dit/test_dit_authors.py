"""The authors' MoH-DiT (SkyworkAI/MoH ``MoH-DiT/models.py``) loaded into the suite's DiT: every key used, and the
loaded model computes their function: outputs, gates, load-balance losses and DiT's loss terms of their own code on
the same weights (tests/data/golden_moh_dit.safetensors, written by tests/make_golden.py).

Their code is never imported here: the parameter names and shapes below are written as data, read off their modules
(``DiT``, ``DiTBlock``, ``MoHAttention``, ``FinalLayer``, timm's ``PatchEmbed`` / ``Mlp``), for the loader's tests.
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from golden import authors_router_shapes, load_golden, prefixed

from moh_lightning.cli import main as moh
from moh_lightning.diffusion import GaussianDiffusionLoss
from moh_lightning.layers import pop_load_balance_loss
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.dit import DiT, DiTConfig, authors_to_dit_state_dict, load_authors_dit, read_state_dict
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion
from moh_lightning.tools.authors_dit import experiment_init_args

# A tiny MoH-DiT in their parametrisation: per block heads h, shared_head h_s and routed_head (their k). Block 0/1:
# every head shared (wg_1 only, as XL/2-90's first 19 blocks); block 2: shared + routed (wg, wg_0, wg_1); block 3:
# routed only (wg).
TINY = {"input_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 48, "num_classes": 5, "head_dim": 8,
        "num_heads": [2, 4, 6, 6], "shared_head": [2, 4, 4, 0], "routed_head": [0, 0, 1, 2]}
GOLDEN, GOLDEN_META = load_golden("moh_dit")
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
    for i, (h, shared, routed) in enumerate(zip(m["num_heads"], m["shared_head"], m["routed_head"], strict=True)):
        b = f"blocks.{i}."
        shapes.update({b + "attn.qkv.weight": (3 * h * d, dim), b + "attn.qkv.bias": (3 * h * d,),
                       b + "attn.proj.weight": (dim, h * d), b + "attn.proj.bias": (dim,),
                       b + "mlp.fc1.weight": (4 * dim, dim), b + "mlp.fc1.bias": (4 * dim,),
                       b + "mlp.fc2.weight": (dim, 4 * dim), b + "mlp.fc2.bias": (dim,),
                       b + "adaLN_modulation.1.weight": (6 * dim, dim), b + "adaLN_modulation.1.bias": (6 * dim,)})
        shapes |= authors_router_shapes(b + "attn.", h, shared, routed, dim)
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
    return DiTConfig(input_size=8, patch_size=2, in_chans=4, embed_dim=48, depth=4, num_heads=TINY["num_heads"],
                     head_dim=8, num_classes=5, moh=MoHConfig(num_shared_heads=TINY["shared_head"],
                                                              top_k=TINY["routed_head"]))


def golden_config() -> DiTConfig:
    """The suite's DiT of the golden file's tiny MoH-DiT (their parametrisation in its ``spec``)."""
    m = GOLDEN_META["spec"]
    return DiTConfig(input_size=m["input_size"], patch_size=m["patch_size"], in_chans=m["in_channels"],
                     embed_dim=m["hidden_size"], depth=len(m["num_heads"]), num_heads=m["num_heads"],
                     head_dim=m["head_dim"], num_classes=m["num_classes"],
                     moh=MoHConfig(num_shared_heads=m["shared_head"], top_k=m["routed_head"]))


def test_their_weights_load_completely_and_compute_their_outputs_and_gates():
    """Their MoH-DiT's own forward, guided forward and gates on the same weights (golden file)."""
    assert GOLDEN_META["source"].startswith("SkyworkAI/MoH@")
    state = prefixed(GOLDEN, "weights")
    model = load_authors_dit(state, golden_config())  # raises on any missing or unexpected key
    assert len(model.state_dict()) == len(state) - 1  # everything but their pos_embed parameter
    x, t, y = GOLDEN["x"], GOLDEN["t"], GOLDEN["y"]
    with torch.no_grad():
        out = model(x, t, y)
        gates = [block.attn.last_gates for block in model.blocks]
        guided = model.forward_with_cfg(x, t, y, 4.0, channels=3)  # their forward_with_cfg guides 3 of 4 channels
    # fp32 rounding of another summation order, on outputs of scale ~5: 1.0e-5 / 2.0e-5 measured on the CI machine
    # (guidance at scale 4 amplifies the forward's gap); a wrong formula moves them by whole units.
    torch.testing.assert_close(out, GOLDEN["out"], atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(guided, GOLDEN["guided"], atol=1e-4, rtol=1e-5)
    for i, ours in enumerate(gates):
        theirs = GOLDEN[f"gates.{i}"]
        assert torch.equal(ours > 0, theirs > 0), f"block {i} keeps other heads"
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert len({tuple(row.nonzero().flatten().tolist()) for row in gates[3].reshape(-1, 6)}) > 3


def test_their_training_terms_and_load_balance_losses():
    """In training their layers append E * sum_i f_i P_i per routed layer, also where top-k is every routed head (a
    constant k there, with no gradient); the suite computes none for such a layer, so its mean over the other layers
    is theirs with the constant removed. DiT's loss terms on the same forward agree."""
    m = GOLDEN_META["spec"]
    model = load_authors_dit(prefixed(GOLDEN, "weights"), golden_config()).train()
    model.y_embedder.dropout_prob = 0.0  # as their run: no random label dropout
    t, y, x0, x_t, noise = GOLDEN["t"], GOLDEN["y"], GOLDEN["train.x0"], GOLDEN["train.x_t"], GOLDEN["train.noise"]
    criterion = GaussianDiffusionLoss(DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear"))
    terms = criterion(model(x_t, t, y), x0, x_t, t, noise)
    for key in ("mse", "vb", "loss"):
        torch.testing.assert_close(terms[key].detach(), GOLDEN[f"train.{key}"], rtol=1e-4, atol=1e-6, msg=key)

    theirs = GOLDEN["train.balance_losses"]
    routed = [i for i, k in enumerate(m["routed_head"]) if k]
    every = [j for j, i in enumerate(routed) if m["routed_head"][i] == m["num_heads"][i] - m["shared_head"][i]]
    assert every and all(float(theirs[j]) == m["routed_head"][routed[j]] for j in every)
    ours = [model.blocks[i].attn.load_balance_loss for i in routed]
    assert [loss is None for loss in ours] == [j in every for j in range(len(routed))]
    kept = [j for j in range(len(routed)) if j not in every]
    torch.testing.assert_close(torch.stack([ours[j] for j in kept]).detach(), theirs[kept], rtol=1e-5, atol=1e-6)
    expected = (theirs.sum() - theirs[every].sum()) / len(kept)
    torch.testing.assert_close(pop_load_balance_loss(model).detach(), expected, rtol=1e-5, atol=1e-6)


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
    with pytest.raises(FileNotFoundError, match="holds 2 weight files"):
        read_state_dict("someone/two")
    with pytest.raises(FileNotFoundError, match="no such weights file"):
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


@pytest.mark.slow
def test_load_authors_dit_writes_a_checkpoint_moh_sample_reads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save(authors_state(TINY), tmp_path / "authors.pt")
    arch = {"input_size": 8, "patch_size": 2, "in_chans": 4, "embed_dim": 48, "depth": 4,
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
