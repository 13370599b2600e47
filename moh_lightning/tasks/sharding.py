"""What every task needs to train unchanged under Lightning's FSDPStrategy as well as DDP or one device."""
from __future__ import annotations

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.optim import Optimizer

# Layers whose weight matrices take weight decay; norms, biases, position embeddings and class tokens do not.
DECAYED_LAYERS = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: decay on the weights of linear, convolution and embedding layers only.

    Chosen by layer type rather than ``param.ndim``: under FSDP (``use_orig_params=True``) the optimizer sees each
    parameter as a 1-D view of this rank's shard, so a shape rule would put every weight in the no-decay group.
    """
    decayed = {id(module.weight) for module in model.modules()
               if isinstance(module, DECAYED_LAYERS) and module.weight is not None}
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if id(param) in decayed else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class ShardableTask(LightningModule):
    """A LightningModule whose gradient clipping and callbacks also work under FSDP."""

    def on_fit_start(self) -> None:
        if not isinstance(self.trainer.strategy, FSDPStrategy):
            return
        for callback in self.trainer.callbacks:
            # It keeps a full copy of the unsharded module and averages it with the shards: a shape error at step 1.
            if isinstance(callback, WeightAveraging):
                raise ValueError(f"{type(callback).__name__} does not support FSDP (it averages full-size weights "
                                 "with FSDP's shards): train with --trainer.strategy ddp, or remove the callback.")

    def configure_gradient_clipping(self, optimizer: Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        # Lightning's FSDP precision plugin refuses norm clipping; FSDP's own clip_grad_norm_ takes the norm over
        # all shards, so every rank scales its shard by the same global factor.
        sharded = isinstance(self.trainer.strategy, FSDPStrategy)
        if gradient_clip_val and sharded and gradient_clip_algorithm in (None, "norm"):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


__all__ = ["ShardableTask", "weight_decay_groups"]
