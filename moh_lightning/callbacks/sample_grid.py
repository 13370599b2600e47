"""Every N training steps, sample a class-by-class grid from the diffusion model and log it (and a small-N FID)."""
from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy
from torchvision.utils import make_grid


class SampleGridCallback(Callback):
    """Logs ``samples/grid`` (one row per class) to TensorBoard every ``every_n_steps`` optimizer steps.

    Samples come from the EMA weights when a ``WeightAveraging`` callback (e.g. ``EMAWeightAveraging``) is present,
    as evaluation does. Latents are decoded with the data module's VAE (its ``vae`` hyperparameter) when it has one.
    With ``fid_num_samples > 0`` it also logs ``samples/fid`` and ``samples/sfid`` of that many uniformly-classed
    samples against ``fid_reference`` (a small-N FID: biased upwards, for trends only).

    Args:
        every_n_steps: Optimizer steps between two grids.
        num_per_class: Samples per class (grid columns).
        max_classes: Classes shown (grid rows), the first ones.
        sampler: ``ddim`` (fast, deterministic) or ``ddpm``.
        steps: Sampling steps.
        cfg_scale: Guidance scale; the model's default when omitted.
        seed: Seed of the noise, the same at every log so grids are comparable.
        fid_num_samples: Samples for the small-N FID; 0 disables it.
        fid_reference: Reference images for it (``mnist``, an ``.npz`` or a folder; see ``moh fidelity``).
        fid_weights: Local Inception weights file for offline machines.
    """

    def __init__(self, every_n_steps: int = 500, num_per_class: int = 8, max_classes: int = 10,
                 sampler: str = "ddim", steps: int = 50, cfg_scale: float | None = None, seed: int = 0,
                 fid_num_samples: int = 0, fid_reference: str = "mnist", fid_weights: str | None = None) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"SampleGridCallback every_n_steps={every_n_steps} must be at least 1.")
        self.every_n_steps = every_n_steps
        self.num_per_class = num_per_class
        self.max_classes = max_classes
        self.sampler = sampler
        self.steps = steps
        self.cfg_scale = cfg_scale
        self.seed = seed
        self.fid_num_samples = fid_num_samples
        self.fid_reference = fid_reference
        self.fid_weights = fid_weights
        self._vae = None
        self._reference = None

    @property
    def hparam_metrics(self) -> tuple[str, ...]:
        """What this callback adds to the metrics runs are compared by (TensorBoard's HParams columns)."""
        return ("samples/fid", "samples/sfid") if self.fid_num_samples else ()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError("SampleGridCallback samples on rank 0 alone, which FSDP's sharded model cannot do: "
                             "train with --trainer.strategy ddp, or remove the callback.")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps or not trainer.is_global_zero:
            return
        task = self._sampling_module(trainer, pl_module)
        classes = min(self.max_classes, pl_module.model.num_classes)
        labels = torch.arange(classes).repeat_interleave(self.num_per_class)
        images = self._generate(trainer, task, labels)
        grid = make_grid((images + 1) / 2, nrow=self.num_per_class, padding=1)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("samples/grid", grid.clamp(0, 1), trainer.global_step)
        if self.fid_num_samples:
            self._log_fid(trainer, task, pl_module)

    def _sampling_module(self, trainer: Trainer, pl_module: LightningModule) -> LightningModule:
        """The EMA copy kept by a WeightAveraging callback, else the module being trained."""
        for callback in trainer.callbacks:
            # Lightning has no public accessor for the average; its AveragedModel wraps a copy of the task.
            average = getattr(callback, "_average_model", None) if isinstance(callback, WeightAveraging) else None
            if average is not None and int(average.n_averaged) > 0:
                return average.module
        return pl_module

    def _generate(self, trainer: Trainer, task: LightningModule, labels: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        x = task.sample(labels, cfg_scale=self.cfg_scale, sampler=self.sampler, steps=self.steps, generator=generator)
        vae_name = getattr(trainer.datamodule, "hparams", {}).get("vae") if trainer.datamodule else None
        if vae_name:
            if self._vae is None:
                from moh_lightning.data.latents import load_vae
                self._vae = load_vae(vae_name).to(x.device).eval()
            with torch.no_grad():
                x = self._vae.decode(x / trainer.datamodule.hparams.latent_scale).sample
        return x.float().clamp(-1, 1).cpu()

    def _log_fid(self, trainer: Trainer, task: LightningModule, pl_module: LightningModule) -> None:
        from moh_lightning.metrics.fidelity import compute_fidelity, load_images, reference_cache_name
        from moh_lightning.tasks.diffusion import to_uint8

        if self._reference is None:
            self._reference = load_images(self.fid_reference, "fid_reference")
        generator = torch.Generator().manual_seed(self.seed + 1)
        labels = torch.randint(0, pl_module.model.num_classes, (self.fid_num_samples,), generator=generator)
        samples = to_uint8(self._generate(trainer, task, labels))
        metrics = compute_fidelity(samples, self._reference, reference_name=reference_cache_name(self.fid_reference),
                                   weights=self.fid_weights)
        pl_module.log_dict({"samples/fid": metrics["fid"], "samples/sfid": metrics["sfid"]})


__all__ = ["SampleGridCallback"]
