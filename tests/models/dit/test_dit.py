"""MoH-DiT: named configurations, DiT's structure and loss, training through the CLI, EMA checkpoints, sampling,
the sample-grid callback and the latent cache."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import printed_config
from tiny_models import dit_t4_config

from moh_lightning.cli import main
from moh_lightning.configs import config_dir
from moh_lightning.diffusion import GaussianDiffusionLoss
from moh_lightning.layers import MoHAttention, activated_head_fraction
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.dit import DiT, DiTConfig, sincos_pos_embed_2d
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion

TINY = dict(input_size=8, patch_size=2, in_chans=2, embed_dim=32, depth=3, num_heads=4, num_classes=5)
# The named DiTs are the shipped configs: dit_<size>_<percent of heads>.yaml (100 = the dense DiT); the pixel-space
# ones (embedded MNIST, a folder) need no data path. Those in the snapshot of shipped configs are built there, once,
# with their whole task, per-layer budgets and the share of heads in their name (tests/cli/test_configs.py).
SNAPSHOT = json.loads((Path(__file__).parents[2] / "data" / "main_settings.json").read_text())
DIT_YAMLS = sorted(p.name for p in config_dir().glob("dit_*.yaml") if p.name not in SNAPSHOT)
PIXEL_SPACE = ("mnist", "folder")


def test_every_named_dit_is_built_here_or_in_the_snapshot():
    assert DIT_YAMLS == ["dit_folder_90.yaml"]
    assert sum(name.startswith("dit_") for name in SNAPSHOT) == 15


@pytest.mark.parametrize("name", DIT_YAMLS)
def test_named_configs_head_budgets(name):
    required = [] if any(kind in name for kind in PIXEL_SPACE) else ["--data.init_args.data_path=/nonexistent"]
    arch = printed_config(["--config", name, *required])["model"]["init_args"]["arch"]
    with torch.device("meta"):
        model = DiT(DiTConfig(**{**arch, "input_size": 4, "num_classes": 10}))
    fraction = activated_head_fraction(model)
    percent = int(Path(name).stem.rsplit("_", 1)[1])
    assert abs(fraction - percent / 100) < 0.015, (name, fraction)
    layers = [block.attn for block in model.blocks]
    assert all(isinstance(layer, MoHAttention) for layer in layers)
    assert all(layer.is_moh for layer in layers) == (percent < 100)
    if percent < 100:  # fewer active heads in shallow blocks than in deep ones
        assert layers[0].active_heads < layers[-1].active_heads


def test_forward_shape_zero_init_and_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = DiT(DiTConfig(**TINY, moh=MoHConfig(num_shared_heads=[1, 2, 4], top_k=[2, 1, 0])))
    x, t, y = torch.randn(3, 2, 8, 8), torch.tensor([0, 10, 999]), torch.tensor([0, 4, 2])
    out = model(x, t, y)
    assert out.shape == (3, 4, 8, 8)
    assert torch.count_nonzero(out) == 0  # adaLN-Zero: zero-initialised final layer
    for name in ("final_layer.linear", "final_layer.adaLN_modulation.1"):
        torch.nn.init.normal_(model.get_submodule(name).weight, std=0.02)
    for block in model.blocks:
        torch.nn.init.normal_(block.adaLN_modulation[1].weight, std=0.02)
    model(x, t, y).square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
    assert [b.attn.active_heads for b in model.blocks] == [3, 3, 4]


def test_bad_head_budget_names_the_block(run_dir):
    with pytest.raises(ValueError, match=r"num_shared_heads=5 \(layer 1\)"):
        DiT(DiTConfig(**TINY, moh=MoHConfig(num_shared_heads=[1, 5, 1], top_k=[1, 1, 1])))
    with pytest.raises(ValueError, match="num_shared_heads has 2 entries"):
        DiT(DiTConfig(**TINY, moh=MoHConfig(num_shared_heads=[1, 1], top_k=1)))
    with pytest.raises(SystemExit, match="dit_q3.yaml: no such file.*shipped configs"):  # not a named DiT
        main(["fit", "--config", "dit_q3.yaml"])


def test_sincos_matches_dit_reference():
    dim, grid = 16, 3
    omega = 1.0 / 10000 ** (np.arange(dim // 4) / (dim / 4))
    gw, gh = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))

    def one_d(pos):
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    reference = np.concatenate([one_d(gw), one_d(gh)], axis=1)  # DiT embeds the width coordinate first
    np.testing.assert_allclose(sincos_pos_embed_2d(dim, grid).numpy(), reference, atol=1e-6)


@pytest.mark.slow
def test_cfg_scale_one_is_the_conditional_model():
    torch.manual_seed(0)
    model = DiT(DiTConfig(**TINY, class_dropout_prob=0.1)).eval()
    torch.nn.init.normal_(model.final_layer.linear.weight)
    for block in model.blocks:  # the label reaches the output only through the (zero-initialised) adaLN layers
        torch.nn.init.normal_(block.adaLN_modulation[1].weight, std=0.1)
    x, t, y = torch.randn(2, 2, 8, 8), torch.tensor([5, 500]), torch.tensor([1, 3])
    torch.testing.assert_close(model.forward_with_cfg(x, t, y, 1.0), model(x, t, y))
    guided = model.forward_with_cfg(x, t, y, 4.0)
    assert not torch.allclose(guided[:, :2], model(x, t, y)[:, :2])
    torch.testing.assert_close(guided[:, 2:], model(x, t, y)[:, 2:])  # variance channels stay conditional


def test_variational_bound_vanishes_for_the_true_posterior():
    task = ClassConditionalDiffusion(dit_t4_config(input_size=8, in_chans=1, num_classes=2))
    loss: GaussianDiffusionLoss = task.criterion
    torch.manual_seed(0)
    x0 = torch.rand(4, 1, 8, 8) * 2 - 1
    t = torch.tensor([1, 10, 500, 999])
    noise = torch.randn_like(x0)
    x_t = task.noise_scheduler.add_noise(x0, noise, t)
    # The true noise and v = -1 (the posterior variance) give exactly q(x_{t-1} | x_t, x_0): KL 0, MSE 0.
    exact = loss(torch.cat([noise, -torch.ones_like(x0)], 1), x0, x_t, t, noise)
    assert exact["mse"].abs().max() < 1e-10 and exact["vb"].abs().max() < 1e-4
    wrong = loss(torch.cat([noise + 0.3, torch.ones_like(x0)], 1), x0, x_t, t, noise)
    assert (wrong["vb"] > 1e-4).all() and torch.allclose(wrong["mse"], torch.full((4,), 0.09))
    decoder = loss(torch.cat([noise, -torch.ones_like(x0)], 1), x0, x_t, torch.zeros(4, dtype=torch.long), noise)
    assert torch.isfinite(decoder["vb"]).all() and (decoder["vb"] >= 0).all()


def test_variational_bound_matches_adm_formulas_for_a_wrong_prediction():
    """The bound term for a model that is off (eps + 0.3, v = 0.2), against ADM's formulas re-computed in float64."""
    task = ClassConditionalDiffusion(dit_t4_config(input_size=8, in_chans=1, num_classes=2))
    torch.manual_seed(0)
    x0 = torch.rand(3, 1, 8, 8, dtype=torch.float64) * 2 - 1
    t = torch.tensor([1, 37, 800])
    noise = torch.randn_like(x0)
    betas = task.noise_scheduler.betas.double()
    abar = torch.cumprod(1 - betas, 0)
    abar_prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
    at = lambda v: v[t].reshape(-1, 1, 1, 1)  # noqa: E731
    x_t = at(abar).sqrt() * x0 + (1 - at(abar)).sqrt() * noise
    eps, v = noise + 0.3, torch.full_like(x0, 0.2)
    posterior_var = betas * (1 - abar_prev) / (1 - abar)
    min_log = torch.log(torch.cat([posterior_var[1:2], posterior_var[1:]]))
    coef1, coef2 = betas * abar_prev.sqrt() / (1 - abar), (1 - abar_prev) * (1 - betas).sqrt() / (1 - abar)
    true_mean = at(coef1) * x0 + at(coef2) * x_t
    pred_x0 = (1 / at(abar)).sqrt() * x_t - (1 / at(abar) - 1).sqrt() * eps
    model_mean = at(coef1) * pred_x0 + at(coef2) * x_t
    model_log = (v + 1) / 2 * at(betas.log()) + (1 - (v + 1) / 2) * at(min_log)
    kl = 0.5 * (-1 + model_log - at(min_log) + (at(min_log) - model_log).exp()
                + (true_mean - model_mean) ** 2 * (-model_log).exp())
    expected = kl.flatten(1).mean(1) / math.log(2.0)
    got = task.criterion.variational_bound(x0.float(), x_t.float(), t, eps.float(), v.float())
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-6)


def _tiny_task(**kwargs) -> ClassConditionalDiffusion:
    return ClassConditionalDiffusion(dit_t4_config(depth=1, embed_dim=32, num_heads=2, input_size=8, in_chans=1,
                                                   num_classes=3), **kwargs)


def test_min_snr_weighting_scales_only_the_mse_term():
    batch = (torch.rand(16, 1, 8, 8) * 2 - 1, torch.randint(0, 3, (16,)))
    plain, weighted = _tiny_task(), _tiny_task(snr_gamma=1.0)
    weighted.load_state_dict(plain.state_dict())
    torch.manual_seed(0)
    reference = plain._diffusion_loss(batch)
    torch.manual_seed(0)
    t = torch.randint(0, 1000, (16,))  # the draw _diffusion_loss makes first
    torch.manual_seed(0)
    losses = weighted._diffusion_loss(batch)
    snr = weighted.noise_scheduler.alphas_cumprod[t] / (1 - weighted.noise_scheduler.alphas_cumprod[t])
    assert (snr > 1).any() and (snr < 1).any()
    torch.testing.assert_close(losses["mse"], reference["mse"])
    assert losses["loss"] < reference["loss"]  # nearly clean steps (SNR > 1) count less
    with pytest.raises(ValueError, match="snr_gamma"):
        _tiny_task(snr_gamma=0.0)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_sampling_uses_the_training_noise_schedule(sampler):
    task = _tiny_task(beta_schedule="squaredcos_cap_v2")
    linear = _tiny_task()
    assert not torch.allclose(task.noise_scheduler.alphas_cumprod, linear.noise_scheduler.alphas_cumprod)
    torch.testing.assert_close(task.sampling_scheduler(sampler, 10).alphas_cumprod,
                               task.noise_scheduler.alphas_cumprod)


@pytest.mark.slow
def test_fit_ema_checkpoint_sample_and_grid(run_dir):
    main(["fit", "--config", "dit_mnist_90", "--trainer.max_steps=3", "--trainer.max_time=null",
          "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1", "--data.init_args.batch_size=8",
          "--trainer.callbacks+=moh_lightning.callbacks.sample_grid.SampleGridCallback",
          "--trainer.callbacks.every_n_steps=2", "--trainer.callbacks.num_per_class=1",
          "--trainer.callbacks.steps=2"])
    checkpoint = next(run_dir.rglob("last.ckpt"))
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert "current_model_state" in state, "EMAWeightAveraging did not write the EMA weights as state_dict"
    events = next(run_dir.rglob("events.out.tfevents*"))
    assert b"samples/grid" in events.read_bytes()

    out = run_dir / "samples"
    main(["sample", "--checkpoint", str(checkpoint), "--out_dir", str(out), "--num_samples", "4",
          "--classes", "[3, 7]", "--steps", "3", "--batch_size", "3", "--cfg_scale", "2.0"])
    data = np.load(out / "samples.npz")
    assert data["arr_0"].shape == (4, 32, 32, 3) and data["arr_0"].dtype == np.uint8
    assert data["arr_1"].tolist() == [3, 7, 3, 7]
    assert len(list((out / "images").glob("*.png"))) == 4 and (out / "grid.png").is_file()
    sample_args = json.loads((out / "sample_args.json").read_text())
    assert sample_args["cfg_scale"] == 2.0 and sample_args["sampler"] == "ddpm"  # the config's, when not given

    task = ClassConditionalDiffusion.load_from_checkpoint(checkpoint, weights_only=False)
    labels = torch.tensor([1, 2])
    a = task.sample(labels, sampler="ddim", steps=4, generator=torch.Generator().manual_seed(1))
    b = task.sample(labels, sampler="ddim", steps=4, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, b)
    assert a.shape == (2, 1, 32, 32) and a.abs().max() <= 1.0 + 1e-6
    with pytest.raises(SystemExit, match="--checkpoint"):
        main(["sample", "--checkpoint", str(run_dir / "missing.ckpt")])


def test_latent_cache_encodes_once_with_flips(tmp_path):
    from diffusers import AutoencoderKL
    from PIL import Image

    from moh_lightning.data.latents import LatentDataModule, load_vae

    torch.manual_seed(0)
    vae_dir = tmp_path / "vae"
    AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                  sample_size=16).save_pretrained(vae_dir)
    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(
                tmp_path / "images" / label / f"{i}.png")
    data = LatentDataModule(str(tmp_path / "images"), cache_dir=str(tmp_path / "cache"), vae=str(vae_dir),
                            image_size=16, batch_size=4, encode_batch_size=4, num_workers=0)
    data.prepare_data()
    (entry,) = (tmp_path / "cache").iterdir()
    stamp = (entry / "latents.npy").stat().st_mtime_ns
    data.prepare_data()
    assert (entry / "latents.npy").stat().st_mtime_ns == stamp  # cached, not re-encoded
    data.setup("fit")
    latents = np.load(entry / "latents.npy")
    assert latents.shape == (6, 2, 4, 8, 8) and latents.dtype == np.float16
    assert not np.allclose(latents[:, 0], latents[:, 1])  # the flipped copy is a different latent
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (4, 4, 8, 8) and x.dtype == torch.float32 and set(y.tolist()) <= {0, 1}
    with pytest.raises(SystemExit, match="local folder"):
        load_vae(str(tmp_path / "no_vae_here"))


def test_checkpoints_written_with_dits_own_channel_name_still_load(tmp_path):
    """``in_chans`` was ``in_channels`` (DiT's name) before the suite used timm's name everywhere."""
    from moh_lightning.serialization import load_file

    config = DiTConfig(**{**TINY, "in_chans": 3})
    state = dict(config.__dict__)
    state["in_channels"] = state.pop("in_chans")
    old = DiTConfig.__new__(DiTConfig)
    old.__dict__.update(state)
    torch.save({"hyper_parameters": {"arch": old}}, tmp_path / "old.ckpt")
    loaded = load_file(tmp_path / "old.ckpt")["hyper_parameters"]["arch"]
    assert loaded.in_chans == 3 and "in_channels" not in vars(loaded)
    assert DiT(loaded).x_embedder.proj.in_channels == 3
