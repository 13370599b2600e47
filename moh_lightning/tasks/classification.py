"""Image classification with a MoH ViT: the paper's MoH-ViT recipe (section 4.1) as a LightningModule.

``ImageClassifier`` trains timm's ViT with MoH attention; ``TransNeXtClassifier`` trains the paper's own MoH-ViTs
(MoH-TransNeXt) with the same recipe and can start from released weights.

Defaults are the recipe: timm's Mixup / CutMix with label smoothing and soft-target cross-entropy, AdamW
(lr 1e-3, weight decay 0.05, no decay on norms, biases and embeddings), a 5-epoch linear warm-up from 1e-6
then cosine decay (timm's scheduler, stepped per optimiser step), load-balance loss beta 0.01. RandAugment,
Random Erasing and DropPath live in the data module and the model config; gradient clipping (1.0) and mixed
precision are Trainer settings in the configs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from moh_lightning.errors import BadValueError
from moh_lightning.models.transnext import TransNeXtConfig, create_transnext, load_pretrained
from moh_lightning.models.vit import ViTConfig, create_vit, load_vit_weights
from moh_lightning.tasks.base import MoHTask, init_from_option, weight_decay_groups
from moh_lightning.value_checks import check_numbers


class ImageClassifier(MoHTask):
    """Trains a (MoH) ViT classifier and reports top-1 / top-5 accuracy.

    Args:
        arch: The architecture, including the MoH head budget (``arch.moh``).
        lr: Peak learning rate after warm-up.
        weight_decay: AdamW weight decay (not applied to norms, biases, position embeddings, class token).
        warmup_epochs: Linear warm-up length, in epochs (fractions allowed).
        warmup_lr: Learning rate at the start of warm-up.
        min_lr: Learning rate at the end of the cosine decay.
        mixup_alpha: Mixup's Beta(alpha, alpha); 0 turns Mixup off.
        cutmix_alpha: CutMix's Beta(alpha, alpha); 0 turns CutMix off.
        mixup_prob: Probability of applying Mixup or CutMix to a batch.
        mixup_switch_prob: Probability of CutMix rather than Mixup when both are on.
        label_smoothing: Label smoothing of the (soft) targets.
        load_balance_beta: Weight beta of the load-balance loss (paper Eq. 8).
        compile: ``auto`` (regional compilation on CUDA, eager on the CPU), ``true`` or ``false`` (``MoHTask``).
        activation_checkpointing: Recompute each block's activations in backward: less memory, about a third more
            compute per step.
        compile_kwargs: Keyword arguments of ``torch.compile`` where ``compile`` compiles, e.g. ``{mode:
            reduce-overhead}`` (CUDA graphs) or ``{backend: aot_eager}`` (``MoHTask``).
        init_from: Weights to start from (``load_vit_weights``): a ``moh fit`` checkpoint of an ``ImageClassifier``
            with any head budget (routers kept where their shapes fit this budget, else fresh), a timm model name or
            a weights file (a dense timm ViT, an ``moh export-timm`` folder's file). Loaded when a run starts, with a
            line saying what was loaded; a run that restores a checkpoint (``--ckpt_path``) ends with its weights.
            ``arch.pretrained``, its name before every task used ``init_from``, still works, with a warning.
        class_names: The name of each class, in label order; ``moh`` links it from the data module, so the
            checkpoint carries it. None: classes by number.
    """

    head_load_group_name = "class"
    hparam_metrics = ("val/loss", "val/acc1")
    #: Classes per image that ``predict_step`` returns (as the top-5 accuracy), fewer when the model has fewer.
    predict_top_k = 5

    def __init__(
            self,
            arch: ViTConfig,
            lr: float = 1e-3,
            weight_decay: float = 0.05,
            warmup_epochs: float = 5.0,
            warmup_lr: float = 1e-6,
            min_lr: float = 1e-5,
            mixup_alpha: float = 0.8,
            cutmix_alpha: float = 1.0,
            mixup_prob: float = 1.0,
            mixup_switch_prob: float = 0.5,
            label_smoothing: float = 0.1,
            load_balance_beta: float = 0.01,
            init_from: str | None = None,
            compile: bool | Literal["auto"] = "auto",
            activation_checkpointing: bool = False,
            compile_kwargs: dict[str, Any] | None = None,
            class_names: list[str] | None = None,
    ) -> None:
        super().__init__(load_balance_beta, compile, activation_checkpointing, compile_kwargs)
        self.save_hyperparameters()
        check_numbers(self.hparams, "model.init_args")
        self.init_from = init_from
        self._init_from_loaded = False
        self.model = self.build_model(arch)
        num_classes = self.model.num_classes
        if num_classes < 2:  # torchmetrics' accuracy would say only "num_classes ... larger than 1"
            raise BadValueError(f"model.init_args.arch.num_classes={num_classes}: a classifier needs two classes or "
                                f"more (the data's class folders, when it has them); give data of two classes or more.")
        self.mixup = None
        if mixup_alpha > 0 or cutmix_alpha > 0:
            self.mixup = Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, prob=mixup_prob,
                               switch_prob=mixup_switch_prob, label_smoothing=label_smoothing,
                               num_classes=num_classes)
            self.train_criterion = SoftTargetCrossEntropy()
        else:
            self.train_criterion = LabelSmoothingCrossEntropy(label_smoothing)
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")

    def build_model(self, arch: ViTConfig | dict) -> nn.Module:
        # LightningCLI records the dataclass as a dict in hparams; the module keeps the typed config.
        config = arch if isinstance(arch, ViTConfig) else ViTConfig(**arch)
        # Read as init_from, so the weights load once when a run starts, not whenever a checkpoint is opened.
        self.init_from = init_from_option(self.init_from, config.pretrained, "arch.pretrained")
        return create_vit(replace(config, pretrained=None))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def example_input(self) -> torch.Tensor:
        embed = self.model.patch_embed  # timm's ViT and TransNeXt both keep the input side they were built for
        return torch.zeros(1, embed.proj.in_channels, *embed.img_size)

    def setup(self, stage: str) -> None:
        data_classes = getattr(self.trainer.datamodule, "num_classes", None)
        if isinstance(data_classes, int) and data_classes != self.model.num_classes:
            raise ValueError(f"model.init_args.arch.num_classes={self.model.num_classes} but the data has "
                             f"{data_classes} classes: set --model.init_args.arch.num_classes={data_classes}.")
        # A checkpoint the trainer restores is loaded after this hook, over these weights.
        if self.init_from and not self._init_from_loaded and not self.restores_checkpoint:
            loaded = self.load_init_from(self.init_from)
            self._init_from_loaded = True
            rank_zero_info(f"moh: model.init_args.init_from={self.init_from}: {loaded}.")

    def load_init_from(self, source: str) -> str:
        """Loads the weights ``source`` into the network; what was loaded, in words (``load_vit_weights``)."""
        return load_vit_weights(self.model, source)

    def head_load_groups(self, batch) -> torch.Tensor:
        """The class of each image, for the per-class head-load views."""
        return batch[1]

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, targets = batch
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        task_loss = self.train_criterion(self(images), targets)
        loss = self.with_load_balance(task_loss)
        self.log("train/task_loss", task_loss)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch, stage: str) -> None:
        images, targets = batch
        logits = self(images)
        self.val_top1(logits, targets)
        self.val_top5(logits, targets)
        self.log(f"{stage}/loss", torch.nn.functional.cross_entropy(logits, targets), sync_dist=True)
        self.log(f"{stage}/acc1", self.val_top1, prog_bar=True)
        self.log(f"{stage}/acc5", self.val_top5)

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """The most probable classes of each image of a batch of (images, their indices in the predict set): the
        ``predict_top_k`` class indices (B, k), most probable first, their probabilities (B, k) and the indices."""
        images, index = batch
        probs = self(images).softmax(-1)
        top = probs.topk(min(self.predict_top_k, probs.shape[-1]), dim=-1)
        return {"index": index, "classes": top.indices, "probs": top.values}

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameter_groups(hp.weight_decay), lr=hp.lr)
        total_steps = max(int(self.trainer.estimated_stepping_batches), 1)
        steps_per_epoch = total_steps / max(self.trainer.max_epochs or 1, 1)
        scheduler = CosineLRScheduler(optimizer, t_initial=total_steps, lr_min=hp.min_lr,
                                      warmup_t=int(hp.warmup_epochs * steps_per_epoch),
                                      warmup_lr_init=hp.warmup_lr, t_in_epochs=False)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def parameter_groups(self, weight_decay: float) -> list[dict]:
        return weight_decay_groups(self.model, weight_decay)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        # timm schedulers count optimiser updates through step_update rather than torch's step().
        scheduler.step_update(num_updates=self.global_step)


class TransNeXtClassifier(ImageClassifier):
    """``ImageClassifier`` (the same recipe and options) over a (MoH-)TransNeXt, the paper's MoH-ViT.

    A class of its own rather than a union in ``arch``: jsonargparse resolves a command-line override such as
    ``--model.init_args.arch.moh.top_k`` against the first type of a union, which would turn a TransNeXt into a ViT.

    Args:
        arch: The TransNeXt architecture and its per-stage head budgets (``arch.moh``).
        init_from: Weights to start from: a file or a hub id (``owner/name``, or ``owner/name:file``) in the suite's
            layout or the authors' (SkyworkAI/MoH's MoH-ViT and TransNeXt's checkpoints); every tensor must fit.
            Loaded when a run starts, as ``ImageClassifier``'s.
        pretrained: ``init_from``'s name before the release that gave every task one name; warns.
        **kwargs: ``ImageClassifier``'s arguments.
    """

    def __init__(self, arch: TransNeXtConfig, init_from: str | None = None, pretrained: str | None = None,
                 **kwargs) -> None:
        super().__init__(arch, init_from=init_from_option(init_from, pretrained, "pretrained"), **kwargs)

    @staticmethod
    def build_model(arch: TransNeXtConfig | dict) -> nn.Module:
        return create_transnext(arch if isinstance(arch, TransNeXtConfig) else TransNeXtConfig(**arch))

    def load_init_from(self, source: str) -> str:
        load_pretrained(self.model, source)
        return "every weight loaded"

    def parameter_groups(self, weight_decay: float) -> list[dict]:
        """TransNeXt's rule: every weight of more than one dimension decays (its learnable tokens and bias too),
        except norms, biases and what its ``no_weight_decay_keywords`` name (position-bias MLP, temperatures,
        query embeddings, local position bias)."""
        skip = self.model.no_weight_decay_keywords()
        layer_weights = {id(p) for p in weight_decay_groups(self.model, weight_decay)[0]["params"]}
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            matrix = id(param) in layer_weights or name.endswith((".learnable_tokens", ".learnable_bias"))
            (decay if matrix and not any(word in name for word in skip) else no_decay).append(param)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
