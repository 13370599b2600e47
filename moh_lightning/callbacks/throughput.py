"""Training throughput (samples/s, tokens/s) and model FLOPs utilisation, counted twice for a MoH model.

Lightning's ``ThroughputMonitor`` takes one FLOP count per batch. A MoH model has two: the dense model's, every head
of every layer (the usual MFU convention, which is what a dense baseline of the same shape would be credited with),
and the heads it actually computed (a head-sparse layer skips the unselected ones). This callback feeds one of
Lightning's ``Throughput`` meters with each, and counts causal attention at half its square in both.

The FLOPs of one training sample (forward and backward) are counted once, at the start of training, with
``torch.utils.flop_counter`` on the task's ``example_input`` with every MoH layer computing all its heads; each
layer's attention core is then scaled by its causal half and, for the computed count, by the share of heads it
computes at that shape on that device (``execution``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from moh_lightning.layers import MoHHeads
from moh_lightning.layers.execution import runs_head_sparse
from moh_lightning.tasks.base import MoHTask

_aten = torch.ops.aten
# The compute dtype of each Trainer precision, for the device's peak FLOP/s.
PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16,
                    "16-true": torch.float16, "32-true": torch.float32, "64-true": torch.float64}


# Dense (no structured sparsity) tensor-core peaks per device, from NVIDIA's datasheets, for the GPUs Lightning's table
# misses or lists at their 2:4-sparse figure: "NVIDIA H200" is not matched by Lightning's names, its "h200 sxm1" entry
# is the sparse 2.0e15 (the H200 computes as the H100 SXM, 989.4 dense bf16 TFLOP/s). Looked up by a substring of
# torch.cuda.get_device_name, first match wins; other GPUs fall back to Lightning's table.
DENSE_PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "h200 nvl": {torch.bfloat16: 835.5e12, torch.float16: 835.5e12, torch.float32: 60e12},
    "h200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "h100 nvl": {torch.bfloat16: 835.5e12, torch.float16: 835.5e12, torch.float32: 60e12},
    "h100 pcie": {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 51.2e12},
    "h100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "b200": {torch.bfloat16: 2.25e15, torch.float16: 2.25e15, torch.float32: 80e12},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s at ``dtype``: ``DENSE_PEAK_FLOPS``, else Lightning's table; None on the CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for chip, peaks in DENSE_PEAK_FLOPS.items():
            if chip in name and dtype in peaks:
                return peaks[dtype]
    return get_available_flops(device, dtype)


# torch counts SDPA's CUDA kernels, not the CPU flash kernel: without these the CPU count would miss attention.
@register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_flash_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                              **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


@dataclass(frozen=True)
class SampleFlops:
    """FLOPs of one training sample (forward and backward): the dense model's and the ones actually computed."""
    dense: float
    computed: float
    tokens: int


def sample_flops(pl_module: LightningModule, root: nn.Module | None = None) -> SampleFlops | None:
    """Count ``SampleFlops`` on one sample of the training shape (the task's ``example_input``, or any module's
    ``example_input_array``); None when the task gives none.

    ``root`` is the module the strategy runs, when it must run the forward itself: an FSDP root gathers each shard
    of its parameters for the forward (every rank counts at once, as training calls it). Run eagerly even when the
    model is compiled, so that the one-sample count costs no compilation.
    """
    # The task's own method: its example_input_array is None under FSDP, where Lightning's summary would run the
    # forward on rank 0 alone.
    example = pl_module.example_input() if isinstance(pl_module, MoHTask) else pl_module.example_input_array
    if example is None:
        return None
    example = tuple(t.to(pl_module.device) for t in (example if isinstance(example, tuple) else (example,)))
    root = pl_module if root is None else root
    layers = {name: m for name, m in root.named_modules() if isinstance(m, MoHHeads)}
    lengths: dict[str, int] = {}

    def record_length(module: MoHHeads, args: tuple) -> None:
        lengths.setdefault(names[module], module.sequence_length(args))

    names = {m: name for name, m in layers.items()}
    hooks = [m.register_forward_pre_hook(record_length) for m in layers.values()]
    executions = {name: m.execution for name, m in layers.items()}
    try:
        for m in layers.values():
            m.execution = "masked"
        # Its own random stream: the count must not move training's (DiT's label dropout draws in this forward),
        # or a resumed run, which counts again, would no longer match the uninterrupted one.
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), FlopCounterMode(display=False) as counter, \
                torch.compiler.set_stance("force_eager"):
            out = root(*example)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    finally:
        for name, m in layers.items():
            m.execution = executions[name]
        for hook in hooks:
            hook.remove()
        pl_module.zero_grad(set_to_none=True)
        for m in layers.values():
            m.last_gates = m.load_balance_loss = None
    counts = counter.get_flop_counts()
    dense = computed = float(counter.get_total_flops())
    device = pl_module.device.type
    for name, layer in layers.items():
        per_op = counts.get(f"{type(root).__name__}.{name}", {})  # the counter's name: the path from the root
        core = float(sum(flops for op, flops in per_op.items() if "scaled_dot_product" in str(op)))
        causal = 0.5 if layer.causal else 1.0
        share = 1.0
        if layer.is_moh and name in lengths and runs_head_sparse(
                layer.execution, device, lengths[name], lengths[name], layer.active_heads / layer.num_heads,
                decoding=False, causal=layer.causal):
            share = layer.active_heads / layer.num_heads
        dense -= core * (1 - causal)
        computed -= core * (1 - causal * share)
    return SampleFlops(dense, computed, next(iter(lengths.values()), 0))


class MoHThroughputMonitor(Callback):
    """Logs ``throughput/samples_per_sec`` and ``throughput/tokens_per_sec`` (all devices), the FLOP/s of one device
    (``throughput/flops_per_sec_dense`` / ``_computed``) and, where the device's peak is known,
    ``throughput/mfu_dense`` and ``throughput/mfu_computed``, every ``log_every_n_steps`` training steps once
    ``window_size`` batches have run.

    Times are wall-clock from the start of training, with validation left out; tokens are the positions the first
    attention layer sees per sample (patches, latent patches or text tokens).

    Args:
        available_flops: Peak FLOP/s of one device; None takes ``peak_flops`` for the device and precision (the
            dense peaks of known GPUs, the H100 and H200 among them; none for the CPU, where MFU is not logged).
        window_size: Batches the rates are averaged over; the run's length when it has fewer steps left.
    """

    def __init__(self, available_flops: float | None = None, window_size: int = 100) -> None:
        super().__init__()
        if window_size < 2:  # Lightning's meter asserts it
            raise ValueError(f"throughput.window_size={window_size}: the rates average over at least 2 batches.")
        self.available_flops = available_flops
        self.window_size = window_size
        self.flops: SampleFlops | None = None
        self._meters: tuple[Throughput, Throughput] | None = None
        self._start = self._paused = 0.0
        self._paused_at: float | None = None
        self._samples = self._batches = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Counted on every rank: the one-sample forward in training mode reaches the load-balance loss's all-reduce
        # under DDP, where rank 0 alone would wait for the others.
        model = trainer.strategy.model
        self.flops = sample_flops(pl_module, model if isinstance(model, FullyShardedDataParallel) else None)
        if not trainer.is_global_zero:
            return
        available = self.available_flops
        if available is None:
            dtype = PRECISION_DTYPES.get(str(trainer.precision), torch.float32)
            available = peak_flops(trainer.strategy.root_device, dtype)
        # Lightning's meter reports nothing until its window is full: a run with fewer steps left than the window
        # averages over what it has.
        left = trainer.estimated_stepping_batches - trainer.global_step
        window = int(min(self.window_size, max(2, left)))
        self._meters = tuple(Throughput(available_flops=available, world_size=trainer.world_size,
                                        window_size=window) for _ in range(2))
        self._samples = self._batches = 0
        self._paused = 0.0
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int
                           ) -> None:
        if self._meters is None or not trainer.is_global_zero:
            return
        last = 0 < trainer.max_steps <= trainer.global_step  # a run shorter than log_every_n_steps still reports
        logs = (trainer.global_step % trainer.log_every_n_steps == 0 or last) and bool(trainer.loggers)
        # Waiting for the device only where a rate is reported: between, the host's clock runs ahead of the device by
        # the work it has queued (a few steps at most), which a window of batches averages out.
        if logs and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._start - self._paused
        self._samples += _batch_size(batch)
        self._batches += 1
        tokens = None if self.flops is None or not self.flops.tokens else self._samples * self.flops.tokens
        # Lightning's meter takes the FLOPs of one step over all devices.
        samples_per_step = _batch_size(batch) * trainer.world_size
        for meter, per_sample in zip(self._meters, (None, None) if self.flops is None else
                                     (self.flops.dense, self.flops.computed), strict=True):
            meter.update(time=elapsed, batches=self._batches, samples=self._samples, lengths=tokens,
                         flops=None if per_sample is None else int(per_sample * samples_per_step))
        if logs:
            self._log(trainer)

    def _log(self, trainer: Trainer) -> None:
        dense, computed = (meter.compute() for meter in self._meters)
        # Rates over all devices (Lightning names them without the device/ prefix only with several devices).
        metrics = {"throughput/samples_per_sec": dense.get("samples_per_sec", dense.get("device/samples_per_sec")),
                   "throughput/tokens_per_sec": dense.get("items_per_sec", dense.get("device/items_per_sec")),
                   "throughput/flops_per_sec_dense": dense.get("device/flops_per_sec"),
                   "throughput/flops_per_sec_computed": computed.get("device/flops_per_sec"),
                   "throughput/mfu_dense": dense.get("device/mfu"),
                   "throughput/mfu_computed": computed.get("device/mfu")}
        metrics = {key: float(value) for key, value in metrics.items() if value is not None}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._meters is not None and not trainer.sanity_checking:
            self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None


def _batch_size(batch) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    while isinstance(batch, (list, tuple, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(batch.shape[0])
