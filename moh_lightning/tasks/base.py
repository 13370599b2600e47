"""The base of every MoH task: the load-balance loss and its weight, head-load groups, sharding-aware training.

A task (a ``LightningModule`` over one of the suite's models, kept in ``self.model``) subclasses ``MoHTask`` and keeps
only what makes it that task: its loss, metrics and optimiser recipe.
"""
from __future__ import annotations

import inspect
import time
import warnings
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch._dynamo.utils import counters
from torch.optim import Optimizer

from moh_lightning import lightning_compat as compat
from moh_lightning.layers import activated_head_fraction, pop_load_balance_loss
from moh_lightning.layers.moh_attention import checkpoint_blocks, compile_blocks

# Layers whose weight matrices take weight decay; norms, biases, position embeddings and class tokens do not.
DECAYED_LAYERS = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d)


def init_from_option(init_from: str | None, old_value: str | None, old_name: str) -> str | None:
    """The weights a task starts from, under the one name every task uses (``init_from``); the task's older name
    (``old_name``) still works for one release, with a warning."""
    if old_value is None:
        return init_from
    if init_from is not None:
        raise ValueError(f"model.init_args.{old_name} and model.init_args.init_from are both set: keep init_from.")
    warnings.warn(f"model.init_args.{old_name} is now model.init_args.init_from; the old name is accepted until the "
                  "next release.", FutureWarning, stacklevel=3)
    return old_value


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


class MoHTask(LightningModule):
    """What every MoH task shares.

    It owns beta, the weight of the routers' load-balance loss (paper Eq. 8): ``with_load_balance`` adds it to the
    task's loss and logs it. ``head_load_groups`` declares what the head-load dashboards compare heads across (the
    image class, the text source, ...). Gradient clipping and the callbacks also work under FSDP.

    Args:
        load_balance_beta: Weight beta of the load-balance loss (>= 0).
        compile: ``auto`` compiles each of the model's repeated blocks once (regional compilation, in place) when a
            Trainer runs it on CUDA, and nothing on the CPU, where compiling pays back little; ``true`` compiles the
            whole model wherever it runs; ``false`` runs eagerly. Blocks of one shape (head budget, stage) share one
            compiled graph. The first step waits for the compilation; when it ends, how long it took and into how
            many graphs the blocks compiled are printed, with a warning if Dynamo's recompile limit was hit (blocks
            past it run eagerly).
        activation_checkpointing: Recompute each block's activations in backward instead of keeping them
            (``torch.utils.checkpoint`` per entry of the model's ``blocks``, TransNeXt's per stage): less memory for
            about a third more compute per step.
        compile_kwargs: Keyword arguments of ``torch.compile`` where ``compile`` compiles (each block, or the whole
            model): ``{mode: reduce-overhead}`` (CUDA graphs), ``{mode: max-autotune}``, ``{backend: aot_eager}``,
            ``{recompile_limit: 16}``, ...; None keeps torch's defaults (Inductor).
    """

    #: What ``head_load_groups`` returns, in words, for the dashboards' labels ("class", "source", ...).
    head_load_group_name: str = "group"
    #: The metrics runs of this task are compared by (TensorBoard's HParams columns): only those it logs.
    hparam_metrics: tuple[str, ...] = ("val/loss",)
    #: The training metrics the progress bar shows. Logged without ``prog_bar``, which Lightning reads from the device
    #: after every batch; the suite's bar reads them at the logging steps only.
    progress_bar_train_metrics: tuple[str, ...] = ("train/loss",)
    #: Set by ``moh`` when this run restores a checkpoint (``--ckpt_path``): its weights replace ``init_from``'s, so
    #: ``init_from`` is not read (Lightning knows the checkpoint only after the setup hooks, where tasks load it).
    restores_checkpoint: bool = False

    def __init__(self, load_balance_beta: float = 0.01, compile: bool | Literal["auto"] = "auto",
                 activation_checkpointing: bool = False, compile_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if load_balance_beta < 0:
            raise ValueError(f"model.init_args.load_balance_beta={load_balance_beta} must be >= 0.")
        if compile not in (True, False, "auto"):
            raise ValueError(f"model.init_args.compile={compile!r}: choose auto, true or false.")
        options = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
        unknown = sorted(set(compile_kwargs or {}) - set(options))
        if unknown:
            raise ValueError(f"model.init_args.compile_kwargs: {', '.join(unknown)} is not an option of "
                             f"torch.compile ({', '.join(options)}).")
        self.load_balance_beta = load_balance_beta
        self.compile_model = compile
        self.compile_kwargs = dict(compile_kwargs or {})
        self.activation_checkpointing = activation_checkpointing
        self.model: torch.nn.Module | None = None
        self._model_compiled = False
        #: What was compiled, in words ("12 blocks", "the model"), for the first step's line.
        self._compiled_what = ""
        #: Dynamo's (graphs, recompile-limit hits) when the model was compiled and when the first step started.
        self._counts_at_compile = self._counts_at_first_step = (0, 0)
        self._first_step_started: float | None = None

    def configure_model(self) -> None:
        """Activation checkpointing and ``torch.compile`` of ``self.model``, each applied once.

        Lightning calls this before the strategy wraps the module. A task that builds its model here builds it first
        and then calls ``super().configure_model()``. Compilation waits for a Trainer (``load_from_checkpoint`` calls
        this hook too, and evaluation tools should not pay a compilation).
        """
        if self.model is None:
            return
        if self.activation_checkpointing:
            checkpoint_blocks(self.model)
        if compat.attached_trainer(self) is None or self._model_compiled:
            return
        if self.compile_model == "auto" and self.trainer.strategy.root_device.type == "cuda":
            blocks = compile_blocks(self.model, **self.compile_kwargs)
            rank_zero_info(f"moh: compile auto: the {blocks} blocks compiled in place (regional compilation), one "
                           f"graph per distinct block; --model.init_args.compile false runs eagerly.")
            self._compiled_what = f"{blocks} blocks"
        elif self.compile_model is True:
            self.model.compile(**self.compile_kwargs)
            self._compiled_what = "the model"
        else:
            return
        self._model_compiled = True
        self._counts_at_compile = dynamo_counts()

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self._model_compiled and self._first_step_started is None:
            self._first_step_started = time.perf_counter()
            self._counts_at_first_step = dynamo_counts()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self._first_step_started is not None and self._first_step_started > 0:
            graphs, limit_hits = dynamo_counts()
            graphs -= self._counts_at_first_step[0]
            rank_zero_info(f"moh: the first compiled step took {time.perf_counter() - self._first_step_started:.1f} s, "
                           f"compilation included: {self._compiled_what} compiled into {graphs} "
                           f"graph{'s' if graphs != 1 else ''}.")
            if limit_hits > self._counts_at_compile[1]:
                limit = self.compile_kwargs.get("recompile_limit") or torch._dynamo.config.recompile_limit
                rank_zero_warn(f"moh: torch.compile hit Dynamo's recompile limit ({limit}): blocks it would have "
                               f"compiled next run eagerly (TORCH_LOGS=recompiles says why; --model.init_args."
                               f"compile_kwargs '{{recompile_limit: {2 * limit}}}' raises it).")
            self._first_step_started = 0.0  # said once

    @property
    def example_input_array(self) -> torch.Tensor | tuple | None:
        """One sample of the training shape (``example_input``), so that the model summary counts FLOPs.

        None before the model is built, and under FSDP, where the summary's forward on rank 0 alone would wait for
        the other ranks' shards.
        """
        trainer = compat.attached_trainer(self)
        if self.model is None or trainer is not None and isinstance(trainer.strategy, FSDPStrategy):
            return None
        return self.example_input()

    def example_input(self) -> torch.Tensor | tuple | None:
        """The ``forward`` arguments of one sample of the training shape; None when the task cannot tell."""
        return None

    def head_load_groups(self, batch) -> torch.Tensor | None:
        """The group (B,) of each sample of ``batch`` for the per-group head-load views; None when it has none."""
        return None

    def with_load_balance(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus beta times the MoH layers' load-balance loss of the last training forward, logged."""
        balance = pop_load_balance_loss(self.model)
        if balance is None:
            return loss
        self.log("train/load_balance_loss", balance)
        return loss + self.load_balance_beta * balance

    def on_validation_epoch_end(self) -> None:
        # The same on every rank; synced only so that Lightning does not warn about an unsynced epoch metric.
        self.log("val/activated_heads", activated_head_fraction(self.model), sync_dist=True)

    def on_test_epoch_end(self) -> None:
        self.log("test/activated_heads", activated_head_fraction(self.model), sync_dist=True)

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


def dynamo_counts() -> tuple[int, int]:
    """(graphs Dynamo has compiled, times it stopped compiling a function at its recompile limit) in this process."""
    limit_hits = sum(count for reason, count in counters["unimplemented"].items()
                     if "recompile limit exceeded" in reason.lower())
    return counters["stats"]["unique_graphs"], limit_hits


__all__ = ["DECAYED_LAYERS", "MoHTask", "dynamo_counts", "weight_decay_groups"]
