"""Class-conditional diffusion with a (MoH-)DiT: DiT's training objective and sampling with diffusers schedulers.

Training follows DiT (Peebles & Xie): 1000-step linear-beta forward process, loss = eps-MSE + the variational bound
term that trains the learned variance (with the predicted mean held fixed), AdamW at a constant 1e-4 with no weight
decay, plus ``beta`` times MoH's load-balance loss. The EMA of the weights is Lightning's ``EMAWeightAveraging``
callback: it swaps the average in for validation and writes it as the checkpoint's ``state_dict``, so a checkpoint
loaded with ``load_from_checkpoint`` samples with the EMA weights. Sampling uses diffusers' ``DDPMScheduler``
(learned-range variance, respaced to e.g. 250 steps) or ``DDIMScheduler`` with classifier-free guidance.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from diffusers import DDIMScheduler, DDPMScheduler
from diffusers.training_utils import compute_snr
from PIL import Image
from torch.optim.lr_scheduler import LambdaLR
from tqdm.auto import tqdm

from moh_lightning.layers.moh_attention import pop_load_balance_loss
from moh_lightning.models.dit import DIT_CONFIGS, build_dit
from moh_lightning.tasks.sharding import ShardableTask

Sampler = Literal["ddpm", "ddim"]
BetaSchedule = Literal["linear", "squaredcos_cap_v2"]


def _mean_flat(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(1)


def _normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """Log-probability of data in [-1, 1] quantised to 256 bins under a Gaussian (the bound's t = 0 decoder term)."""
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = torch.special.ndtr(inv_std * (centered + 1.0 / 255.0))
    cdf_min = torch.special.ndtr(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


class GaussianDiffusionLoss(torch.nn.Module):
    """DiT's training loss for a learned-variance eps-model on a diffusers noise schedule.

    diffusers' schedulers provide the schedule and the sampling steps but no training losses, so the variational
    bound term of Nichol & Dhariwal (used by DiT as ``loss = mse + vb``) is written here. The variance output v in
    [-1, 1] interpolates log-variance between the clipped posterior variance and beta_t, as ``learned_range``.
    """

    def __init__(self, scheduler: DDPMScheduler) -> None:
        super().__init__()
        betas = scheduler.betas.double()
        alphas_cumprod = scheduler.alphas_cumprod.double()
        alphas_cumprod_prev = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        # The t = 0 posterior variance is 0; DiT clips its log by repeating the t = 1 value.
        posterior_log_variance = torch.log(torch.cat([posterior_variance[1:2], posterior_variance[1:]]))
        buffers = {
            "sqrt_recip_alphas_cumprod": torch.sqrt(1.0 / alphas_cumprod),
            "sqrt_recipm1_alphas_cumprod": torch.sqrt(1.0 / alphas_cumprod - 1.0),
            "posterior_mean_coef1": betas * torch.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - alphas_cumprod_prev) * torch.sqrt(1.0 - betas) / (1.0 - alphas_cumprod),
            "posterior_log_variance": posterior_log_variance,
            "log_betas": torch.log(betas),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value.float(), persistent=False)
        self.num_timesteps = len(betas)

    def _at(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return getattr(self, name)[t].reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)

    def variational_bound(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor,
                          var_values: torch.Tensor) -> torch.Tensor:
        """Per-sample bound term in bits per dimension: KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t)), decoder NLL at t=0."""
        pred_x0 = self._at("sqrt_recip_alphas_cumprod", t, x_t) * x_t - self._at("sqrt_recipm1_alphas_cumprod", t, x_t) * eps
        coef1, coef2 = self._at("posterior_mean_coef1", t, x_t), self._at("posterior_mean_coef2", t, x_t)
        model_mean = coef1 * pred_x0 + coef2 * x_t
        true_mean = coef1 * x0 + coef2 * x_t
        min_log = self._at("posterior_log_variance", t, x_t)
        frac = (var_values + 1) / 2
        model_log_variance = frac * self._at("log_betas", t, x_t) + (1 - frac) * min_log
        kl = _mean_flat(_normal_kl(true_mean, min_log, model_mean, model_log_variance)) / math.log(2.0)
        nll = -_mean_flat(_discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_variance)) / math.log(2.0)
        return torch.where(t == 0, nll, kl)

    def forward(self, model_output: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                noise: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample ``mse``, ``vb`` (zero without a variance output) and their sum ``loss``."""
        channels = x0.shape[1]
        eps = model_output[:, :channels]
        mse = _mean_flat((noise - eps) ** 2)
        if model_output.shape[1] == 2 * channels:
            # The bound trains only the variance: the mean's gradient comes from the MSE alone (eps detached).
            vb = self.variational_bound(x0, x_t, t, eps.detach(), model_output[:, channels:])
            vb = vb * self.num_timesteps / 1000.0  # DiT's RESCALED_MSE loss type
        else:
            vb = torch.zeros_like(mse)
        return {"loss": mse + vb, "mse": mse, "vb": vb}


class ClassConditionalDiffusion(ShardableTask):
    """Trains and samples a class-conditional (MoH-)DiT.

    Args:
        model: Name of a configuration in ``moh_lightning.models.dit.DIT_CONFIGS`` (e.g. ``MoH-DiT-S/2-90``).
        model_args: Overrides of that configuration (any ``DiT`` argument, e.g. ``depth`` or ``top_k``).
        input_size: Side of the (latent or pixel) grid the model sees.
        in_channels: Channels of that grid (4 for SD-VAE latents, 1 for grey digits).
        num_classes: Conditioning classes.
        learning_rate: AdamW learning rate (constant after warm-up).
        weight_decay: AdamW weight decay.
        warmup_steps: Linear learning-rate warm-up steps (0 as DiT).
        load_balance_coef: beta, the weight of MoH's load-balance loss (>= 0).
        num_train_timesteps: Steps of the forward process.
        beta_start: First beta of the linear schedule.
        beta_end: Last beta of the linear schedule.
        beta_schedule: ``"linear"`` (DiT) or ``"squaredcos_cap_v2"``, the cosine schedule of Nichol & Dhariwal,
            which keeps fewer steps at near-pure noise and suits small pixel-space images.
        snr_gamma: Min-SNR-gamma weighting of the eps-MSE (Hang et al., ICCV 2023): each timestep's term is scaled
            by min(SNR, gamma) / SNR, so the nearly clean steps stop dominating the gradient. None keeps DiT's
            unweighted objective; 5 is the paper's value.
        sampler: Default sampler, ``"ddpm"`` (learned variance) or ``"ddim"`` (deterministic).
        sample_steps: Default number of respaced sampling steps.
        cfg_scale: Default classifier-free guidance scale (1 = no guidance).
        clip_sample: Clip the predicted clean sample to [-1, 1] while sampling (pixels yes, latents no).
    """

    def __init__(
            self,
            model: str = "MoH-DiT-S/2-90",
            model_args: dict[str, Any] | None = None,
            input_size: int = 32,
            in_channels: int = 4,
            num_classes: int = 1000,
            learning_rate: float = 1e-4,
            weight_decay: float = 0.0,
            warmup_steps: int = 0,
            load_balance_coef: float = 0.01,
            num_train_timesteps: int = 1000,
            beta_start: float = 1e-4,
            beta_end: float = 0.02,
            beta_schedule: BetaSchedule = "linear",
            snr_gamma: float | None = None,
            sampler: Sampler = "ddpm",
            sample_steps: int = 250,
            cfg_scale: float = 1.0,
            clip_sample: bool = False,
    ) -> None:
        super().__init__()
        if load_balance_coef < 0:
            raise ValueError(f"load_balance_coef={load_balance_coef} must be >= 0.")
        if snr_gamma is not None and snr_gamma <= 0:
            raise ValueError(f"snr_gamma={snr_gamma} must be > 0, or null for DiT's unweighted loss.")
        if sampler not in ("ddpm", "ddim"):
            raise ValueError(f"sampler={sampler!r}: choose 'ddpm' or 'ddim'.")
        if model not in DIT_CONFIGS:
            raise ValueError(f"model={model!r} is not a named DiT; choose one of {', '.join(DIT_CONFIGS)}.")
        self.save_hyperparameters()
        self.model = build_dit(model, **{"input_size": input_size, "in_channels": in_channels,
                                         "num_classes": num_classes, **(model_args or {})})
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule,
                                             beta_start=beta_start, beta_end=beta_end, clip_sample=False)
        self.criterion = GaussianDiffusionLoss(self.noise_scheduler)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, t, y)

    def _diffusion_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x0, y = batch
        t = torch.randint(0, self.criterion.num_timesteps, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        x_t = self.noise_scheduler.add_noise(x0, noise, t)
        losses = self.criterion(self.model(x_t, t, y), x0, x_t, t, noise)
        if self.hparams.snr_gamma is not None:
            snr = compute_snr(self.noise_scheduler, t)
            weight = snr.clamp(max=self.hparams.snr_gamma) / snr
            losses["loss"] = weight * losses["mse"] + losses["vb"]
        return {name: value.mean() for name, value in losses.items()}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        losses = self._diffusion_loss(batch)
        loss = losses["loss"]
        balance = pop_load_balance_loss(self.model)
        if balance is not None:
            loss = loss + self.hparams.load_balance_coef * balance
            self.log("train/load_balance_loss", balance)
        self.log_dict({"train/loss": loss, "train/mse": losses["mse"], "train/vb": losses["vb"]}, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        losses = self._diffusion_loss(batch)
        self.log_dict({"val/loss": losses["loss"], "val/mse": losses["mse"], "val/vb": losses["vb"]}, prog_bar=True,
                      sync_dist=True)  # the mean over ranks, so every rank's checkpoint callback sees one value

    def head_load_groups(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The conditioning class of every sample, for the head-load callback's per-class plots."""
        return batch[1]

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.hparams.learning_rate,
                                      weight_decay=self.hparams.weight_decay)
        warmup = self.hparams.warmup_steps
        if not warmup:
            return optimizer
        schedule = LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def sampling_scheduler(self, sampler: Sampler | None = None, steps: int | None = None):
        """A diffusers scheduler over ``steps`` evenly spaced timesteps of the training schedule."""
        sampler = sampler or self.hparams.sampler
        steps = steps or self.hparams.sample_steps
        common = dict(num_train_timesteps=self.criterion.num_timesteps, beta_schedule=self.hparams.beta_schedule,
                      beta_start=self.hparams.beta_start, beta_end=self.hparams.beta_end,
                      clip_sample=self.hparams.clip_sample, timestep_spacing="linspace")
        if sampler == "ddpm":
            variance = "learned_range" if self.model.learn_sigma else "fixed_small"
            scheduler = DDPMScheduler(variance_type=variance, **common)
        elif sampler == "ddim":
            scheduler = DDIMScheduler(set_alpha_to_one=True, **common)  # the last step lands on x_0, as ADM's DDIM
        else:
            raise ValueError(f"sampler={sampler!r}: choose 'ddpm' or 'ddim'.")
        scheduler.set_timesteps(steps)
        return scheduler

    @torch.no_grad()
    def sample(self, labels: torch.Tensor, cfg_scale: float | None = None, sampler: Sampler | None = None,
               steps: int | None = None, generator: torch.Generator | None = None,
               progress: bool = False) -> torch.Tensor:
        """Samples (B, C, H, W) in the model's space (pixels in [-1, 1] or scaled latents) for ``labels`` (B,)."""
        cfg_scale = self.hparams.cfg_scale if cfg_scale is None else cfg_scale
        scheduler = self.sampling_scheduler(sampler, steps)
        was_training = self.model.training
        self.model.eval()
        labels = labels.to(self.device)
        size, channels = self.hparams.input_size, self.model.in_channels
        x = torch.randn(len(labels), channels, size, size, generator=generator, device="cpu").to(self.device)
        for t in tqdm(scheduler.timesteps, disable=not progress, desc="sampling", leave=False):
            t_batch = torch.full((len(labels),), int(t), device=self.device, dtype=torch.long)
            if cfg_scale != 1.0:
                out = self.model.forward_with_cfg(x, t_batch, labels, cfg_scale)
            else:
                out = self.model(x, t_batch, labels)
            if isinstance(scheduler, DDIMScheduler):
                out = out[:, :channels]
            x = scheduler.step(out, t, x, generator=generator).prev_sample
        self.model.train(was_training)
        return x


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) in [-1, 1] -> (B, H, W, 3) uint8, grey repeated to RGB (the layout of ADM's .npz files)."""
    images = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    return images.permute(0, 2, 3, 1).numpy()


def sample(
        checkpoint: str,
        out_dir: str = "samples",
        num_samples: int = 100,
        classes: list[int] | None = None,
        cfg_scale: float | None = None,
        sampler: Sampler | None = None,
        steps: int | None = None,
        seed: int = 0,
        batch_size: int = 50,
        vae: str | None = None,
        latent_scale: float = 0.18215,
        device: str = "cpu",
) -> Path:
    """Samples images from a trained ClassConditionalDiffusion checkpoint (its EMA weights).

    Writes ``out_dir/images/NNNNNN_cC.png``, ``out_dir/samples.npz`` (ADM layout: ``arr_0`` (N, H, W, 3) uint8,
    ``arr_1`` the labels), ``out_dir/grid.png`` (one row per class) and ``out_dir/sample_args.json``.

    Args:
        checkpoint: Path of a ``.ckpt`` written by ``moh fit`` with a ClassConditionalDiffusion model.
        out_dir: Folder for the outputs (created).
        num_samples: Number of images.
        classes: Conditioning classes, repeated in turn to ``num_samples``; drawn uniformly when omitted.
        cfg_scale: Classifier-free guidance scale (1 disables guidance); omitted: the checkpoint's ``cfg_scale``.
        sampler: ``ddpm`` (learned variance, ancestral) or ``ddim`` (deterministic); omitted: the checkpoint's.
        steps: Respaced sampling steps (DiT uses 250 DDPM steps); omitted: the checkpoint's ``sample_steps``.
        seed: Seed of the noise and of drawn classes.
        batch_size: Images sampled at once.
        vae: Hub id or local folder of the AutoencoderKL that decodes latents; omitted: the one the checkpoint's
            data module used, or none for pixel-space models.
        latent_scale: Latent scaling factor of that VAE (0.18215 for Stable Diffusion's).
        device: Torch device to sample on.
    """
    path = Path(checkpoint)
    if not path.is_file():
        raise SystemExit(f"sample: --checkpoint {checkpoint}: no such file; pass a .ckpt written by `moh fit`.")
    task = ClassConditionalDiffusion.load_from_checkpoint(path, map_location=device, weights_only=False)
    task.eval()
    cfg_scale = task.hparams.cfg_scale if cfg_scale is None else cfg_scale
    sampler = sampler or task.hparams.sampler
    steps = steps or task.hparams.sample_steps
    if vae is None:
        data_hparams = torch.load(path, map_location="cpu", weights_only=False).get("datamodule_hyper_parameters", {})
        vae = data_hparams.get("vae")
        latent_scale = data_hparams.get("latent_scale", latent_scale)
    decoder = None
    if vae:
        from moh_lightning.data.latents import load_vae
        decoder = load_vae(vae, key="--vae").to(device).eval()

    generator = torch.Generator().manual_seed(seed)
    if classes:
        labels = torch.tensor([classes[i % len(classes)] for i in range(num_samples)])
    else:
        labels = torch.randint(0, task.hparams.num_classes, (num_samples,), generator=generator)
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    arrays = []
    for start in tqdm(range(0, num_samples, batch_size), desc="batches"):
        batch_labels = labels[start:start + batch_size]
        x = task.sample(batch_labels, cfg_scale=cfg_scale, sampler=sampler, steps=steps, generator=generator,
                        progress=True)
        if decoder is not None:
            with torch.no_grad():
                x = decoder.decode(x / latent_scale).sample
        arrays.append(to_uint8(x))
    images = np.concatenate(arrays)
    for i, (image, label) in enumerate(zip(images, labels.tolist())):
        Image.fromarray(image).save(out / "images" / f"{i:06d}_c{label}.png")
    np.savez(out / "samples.npz", arr_0=images, arr_1=labels.numpy())
    save_class_grid(images, labels.numpy(), out / "grid.png")
    (out / "sample_args.json").write_text(json.dumps(
        dict(checkpoint=str(path), num_samples=num_samples, classes=classes, cfg_scale=cfg_scale, sampler=sampler,
             steps=steps, seed=seed, vae=vae), indent=2))
    print(f"wrote {num_samples} samples to {out}")
    return out


def save_class_grid(images: np.ndarray, labels: np.ndarray, path: Path, per_class: int = 10) -> None:
    """PNG grid with one row per class present in ``labels`` and up to ``per_class`` samples of it."""
    rows = []
    for label in np.unique(labels):
        row = images[labels == label][:per_class]
        row = np.concatenate([row, np.zeros((per_class - len(row), *row.shape[1:]), np.uint8)])
        rows.append(np.concatenate(list(row), axis=1))
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)


__all__ = ["ClassConditionalDiffusion", "GaussianDiffusionLoss", "sample", "save_class_grid", "to_uint8"]
