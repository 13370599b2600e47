"""Class-conditional diffusion with a (MoH-)DiT: DiT's training objective and sampling with diffusers schedulers.

Training follows DiT (Peebles & Xie): 1000-step linear-beta forward process, loss = eps-MSE + the variational bound
term that trains the learned variance (with the predicted mean held fixed), AdamW at a constant 1e-4 with no weight
decay, plus ``beta`` times MoH's load-balance loss. The EMA of the weights is an ``EMAWeightAveraging`` callback
(Lightning's, or the suite's fused one): it swaps the average in for validation and writes it as the checkpoint's
``state_dict``, so a checkpoint loaded with ``load_from_checkpoint`` samples with the EMA weights. Sampling uses
diffusers' ``DDPMScheduler`` (learned-range variance, respaced to e.g. 250 steps) or ``DDIMScheduler`` with
classifier-free guidance.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR
from tqdm.auto import tqdm

from moh_lightning.diffusion import GaussianDiffusionLoss
from moh_lightning.models.dit import DiT, DiTConfig, load_dense_dit_weights
from moh_lightning.tasks.base import MoHTask, init_from_option
from moh_lightning.value_checks import check_numbers

if TYPE_CHECKING:
    from diffusers import DDIMScheduler, DDPMScheduler

Sampler = Literal["ddpm", "ddim"]
BetaSchedule = Literal["linear", "squaredcos_cap_v2"]


class ClassConditionalDiffusion(MoHTask):
    """Trains and samples a class-conditional (MoH-)DiT.

    Args:
        arch: The network, including the MoH head budget (``arch.moh``), the grid it sees and its classes.
        lr: AdamW learning rate (constant after warm-up).
        weight_decay: AdamW weight decay.
        warmup_steps: Linear learning-rate warm-up steps (0 as DiT).
        load_balance_beta: Weight beta of MoH's load-balance loss (>= 0).
        compile: ``auto`` (regional compilation on CUDA, eager on the CPU), ``true`` or ``false`` (``MoHTask``).
        activation_checkpointing: Recompute each block's activations in backward: less memory, about a third more
            compute per step.
        compile_kwargs: Keyword arguments of ``torch.compile`` where ``compile`` compiles, e.g. ``{mode:
            reduce-overhead}`` (CUDA graphs) or ``{backend: aot_eager}`` (``MoHTask``).
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
        cfg_channels: Guide only the first this many noise channels; None guides all. DiT's sampling code guides 3
            of the 4 latent channels, which its published FIDs were measured with: set 3 to reproduce them.
        clip_sample: Clip the predicted clean sample to [-1, 1] while sampling (pixels yes, latents no).
        init_from: Start from a dense DiT checkpoint in the authors' layout (``DiT-XL-2-256x256.pt``), every
            weight loaded, the routers fresh (``load_dense_dit_weights``).
        init_from_dense: ``init_from``'s name before the release that gave every task one name; warns.
        class_names: The name of each class, in label order; ``moh`` links it from the data module (its class
            folders), so the checkpoint carries it and ``moh sample --classes`` takes names. None: classes by number.
    """

    head_load_group_name = "class"
    progress_bar_train_metrics = ("train/loss", "train/mse", "train/vb")

    def __init__(
            self,
            arch: DiTConfig,
            lr: float = 1e-4,
            weight_decay: float = 0.0,
            warmup_steps: int = 0,
            load_balance_beta: float = 0.01,
            num_train_timesteps: int = 1000,
            beta_start: float = 1e-4,
            beta_end: float = 0.02,
            beta_schedule: BetaSchedule = "linear",
            snr_gamma: float | None = None,
            sampler: Sampler = "ddpm",
            sample_steps: int = 250,
            cfg_scale: float = 1.0,
            cfg_channels: int | None = None,
            clip_sample: bool = False,
            init_from: str | None = None,
            init_from_dense: str | None = None,
            compile: bool | Literal["auto"] = "auto",
            activation_checkpointing: bool = False,
            compile_kwargs: dict[str, Any] | None = None,
            class_names: list[str] | None = None,
    ) -> None:
        super().__init__(load_balance_beta, compile, activation_checkpointing, compile_kwargs)
        if snr_gamma is not None and snr_gamma <= 0:
            raise ValueError(f"snr_gamma={snr_gamma} must be > 0, or null for DiT's unweighted loss.")
        if sampler not in ("ddpm", "ddim"):
            raise ValueError(f"sampler={sampler!r}: choose 'ddpm' or 'ddim'.")
        if class_names is not None and len(class_names) != arch_classes(arch):
            raise ValueError(f"class_names has {len(class_names)} names for {arch_classes(arch)} classes "
                             f"(arch.num_classes); give one name per class, or null.")
        self.save_hyperparameters()
        check_numbers(self.hparams, "model.init_args")
        # LightningCLI records the dataclass as a dict in hparams; the module keeps the typed config.
        self.model = DiT(arch if isinstance(arch, DiTConfig) else DiTConfig(**arch))
        self.init_from = init_from_option(init_from, init_from_dense, "init_from_dense")
        if self.init_from:
            load_dense_dit_weights(self.model, self.init_from)
        if cfg_channels is not None and not 1 <= cfg_channels <= self.model.in_chans:
            raise ValueError(f"cfg_channels={cfg_channels} must be between 1 and the model's "
                             f"{self.model.in_chans} channels, or null to guide all.")
        # diffusers is imported where a DiT needs it: at the top it cost every `moh` command (ViT, LLM) a second.
        from diffusers import DDPMScheduler

        self.noise_scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule,
                                             beta_start=beta_start, beta_end=beta_end, clip_sample=False)
        self.criterion = GaussianDiffusionLoss(self.noise_scheduler)
        #: The timesteps (B,) drawn for the last training or validation batch, for the head-load views per noise level.
        self.last_timesteps: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, t, y)

    def example_input(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        config = self.model.config
        x = torch.zeros(1, config.in_chans, config.input_size, config.input_size)
        return x, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)

    def _diffusion_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x0, y = batch
        t = torch.randint(0, self.criterion.num_timesteps, (x0.shape[0],), device=x0.device)
        self.last_timesteps = t
        noise = torch.randn_like(x0)
        x_t = self.noise_scheduler.add_noise(x0, noise, t)
        losses = self.criterion(self.model(x_t, t, y), x0, x_t, t, noise)
        if self.hparams.snr_gamma is not None:
            from diffusers.training_utils import compute_snr

            snr = compute_snr(self.noise_scheduler, t)
            weight = snr.clamp(max=self.hparams.snr_gamma) / snr
            losses["loss"] = weight * losses["mse"] + losses["vb"]
        return {name: value.mean() for name, value in losses.items()}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        losses = self._diffusion_loss(batch)
        loss = self.with_load_balance(losses["loss"])
        self.log_dict({"train/loss": loss, "train/mse": losses["mse"], "train/vb": losses["vb"]})
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        losses = self._diffusion_loss(batch)
        self.log_dict({"val/loss": losses["loss"], "val/mse": losses["mse"], "val/vb": losses["vb"]}, prog_bar=True,
                      sync_dist=True)  # the mean over ranks, so every rank's checkpoint callback sees one value

    def head_load_groups(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The conditioning class of every sample, for the per-class head-load views."""
        return batch[1]

    def predict_problem(self) -> str:
        """Why ``moh predict`` does not apply: a diffusion model draws samples of classes, which ``moh sample`` does."""
        return ("a ClassConditionalDiffusion model draws samples rather than predicting: use moh sample --checkpoint "
                "<ckpt> --classes '[0, 1]' --out_dir samples.")

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr,
                                      weight_decay=self.hparams.weight_decay)
        warmup = self.hparams.warmup_steps
        if not warmup:
            return optimizer
        schedule = LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def sampling_scheduler(self, sampler: Sampler | None = None,
                           steps: int | None = None) -> DDPMScheduler | DDIMScheduler:
        """A diffusers scheduler over ``steps`` timesteps of the training schedule, spaced as ADM / DiT space them.

        DDPM respacing takes ``round(linspace(0, T - 1, steps))`` (ADM's ``space_timesteps``, e.g. "250"); DDIM takes
        every (T // steps)-th step from 0 (ADM's "ddim50": 0, 20, ..., 980), diffusers' "leading" spacing.
        """
        from diffusers import DDIMScheduler, DDPMScheduler

        sampler = sampler or self.hparams.sampler
        steps = steps or self.hparams.sample_steps
        common = dict(num_train_timesteps=self.criterion.num_timesteps, beta_schedule=self.hparams.beta_schedule,
                      beta_start=self.hparams.beta_start, beta_end=self.hparams.beta_end,
                      clip_sample=self.hparams.clip_sample)
        if sampler == "ddpm":
            variance = "learned_range" if self.model.learn_sigma else "fixed_small"
            scheduler = DDPMScheduler(variance_type=variance, timestep_spacing="linspace", **common)
        elif sampler == "ddim":
            # The last step lands on x_0 (alpha_prev = 1), as ADM's DDIM.
            scheduler = DDIMScheduler(set_alpha_to_one=True, timestep_spacing="leading", steps_offset=0, **common)
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
        # DDPM's learned-range step reads the model's variance channels; every other step takes eps alone.
        predicts_sigma = scheduler.config.get("variance_type") == "learned_range"
        was_training = self.model.training
        self.model.eval()
        labels = labels.to(self.device)
        size, channels = self.model.config.input_size, self.model.in_chans
        x = torch.randn(len(labels), channels, size, size, generator=generator, device="cpu").to(self.device)
        for t in tqdm(scheduler.timesteps, disable=not progress, desc="sampling", leave=False):
            t_batch = torch.full((len(labels),), int(t), device=self.device, dtype=torch.long)
            if cfg_scale != 1.0:
                out = self.model.forward_with_cfg(x, t_batch, labels, cfg_scale, self.hparams.get("cfg_channels"))
            else:
                out = self.model(x, t_batch, labels)
            if not predicts_sigma:
                out = out[:, :channels]
            x = scheduler.step(out, t, x, generator=generator).prev_sample
        self.model.train(was_training)
        return x


def arch_classes(arch: DiTConfig | dict) -> int:
    """``num_classes`` of a DiT config, typed or as the dict LightningCLI records."""
    return arch.num_classes if isinstance(arch, DiTConfig) else arch.get("num_classes", DiTConfig.num_classes)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Samples (B, C, H, W) in [-1, 1] -> (B, H, W, 3) uint8, grey repeated to RGB (the layout of ADM's .npz files)."""
    images = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    if images.shape[1] == 1:
        images = images.repeat(1, 3, 1, 1)
    return images.permute(0, 2, 3, 1).numpy()


__all__ = ["ClassConditionalDiffusion", "arch_classes", "to_uint8"]
