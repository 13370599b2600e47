"""A training step never makes the host wait for the device, except at the logging steps, and leaves nothing on the
MoH layers that the next step's CUDA-graph replay would write over.

On a GPU the host must queue the next kernels before the device finishes the last ones: a read of a device value
(``.item()``, ``bool(tensor)``, ``float(tensor)``: aten's ``_local_scalar_dense``) or a collective in every step stalls
that queue. Each task's CPU default runs a few steps under a dispatch mode that counts the reads, with the strategy's
collectives counted by wrapping them, and with every shipped callback on.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
from lightning.pytorch import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from moh_lightning import lightning_compat as compat
from moh_lightning.cli import main
from moh_lightning.layers import MoHHeads

COLLECTIVES = ("reduce", "reduce_boolean_decision", "all_gather", "broadcast", "barrier")
LOG_EVERY = 4
STEPS = 9


class _Reads(TorchDispatchMode):
    """Counts ``_local_scalar_dense`` calls (with where they came from), except on ``exempt`` storages and in the
    loader: a batch is made of host tensors (torchvision's transforms read their own parameters), then moved."""

    def __init__(self, exempt) -> None:
        super().__init__()
        self.exempt, self.reads = exempt, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.exempt(args[0]):
            stack = traceback.format_stack()[:-1]
            if not any(f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}" in frame for frame in stack):
                self.reads.append("".join(stack[-12:]))
        return func(*args, **(kwargs or {}))


class StepReads(Callback):
    """Counts the device reads and collectives from each training batch's start to the next one's, per step.

    AdamW keeps its step counter in a CPU tensor and reads it (``.item()``) in every step: a read of the host's own
    memory, which waits for nothing. Such reads are told apart by identity: their tensor's storage is one of the
    optimizers' ``step`` states. (On CUDA the test below runs under torch's sync debug mode instead, which sees only
    what waits for the device.)
    """

    found: dict[int, dict[str, list[str]]] = {}
    logging_steps: set[int] = set()

    def __init__(self) -> None:
        self.mode: _Reads | None = None
        self.step: int | None = None
        self.collectives: list[str] = []
        type(self).found, type(self).logging_steps = {}, set()

    def setup(self, trainer, pl_module, stage) -> None:
        for name in COLLECTIVES:
            original = getattr(trainer.strategy, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                if self.mode is not None:
                    self.collectives.append(f"{_name}\n" + "".join(traceback.format_stack(limit=8)[:-1]))
                return _original(*args, **kwargs)

            setattr(trainer.strategy, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._close()
        # What a step's forward leaves on the MoH layers is taken within that step (the loss by the task, the gates
        # by the head-load counter): under CUDA graphs the next replay writes over it.
        held = [name for name, layer in pl_module.named_modules() if isinstance(layer, MoHHeads)
                and (layer.last_gates is not None or layer.load_balance_loss is not None)]
        assert not held, f"before step {trainer.global_step} these layers still hold the last step's tensors: {held}"
        optimizers = trainer.optimizers

        def exempt(tensor: torch.Tensor) -> bool:
            ptr = tensor.untyped_storage().data_ptr()
            return any(state.get("step") is not None and state["step"].untyped_storage().data_ptr() == ptr
                       for optimizer in optimizers for state in optimizer.state.values())

        self.step = trainer.global_step
        if compat.logs_this_step(trainer):
            type(self).logging_steps.add(self.step)
        self.mode = _Reads(exempt)
        self.mode.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def _close(self) -> None:
        if self.mode is None:
            return
        self.mode.__exit__(None, None, None)
        type(self).found[self.step] = {"reads": self.mode.reads, "collectives": self.collectives}
        self.mode, self.collectives = None, []


# Two blocks where a config has more: what could read the device is the step and its callbacks, at any depth.
TASKS = {
    "vit_tiny_mnist_75.yaml": ["--data.init_args.batch_size=16", "--model.init_args.arch.depth=2"],
    # The recipe's EMA from the first step (it starts at 400): its update is a step's work too.
    "dit_mnist_75.yaml": ["--data.init_args.batch_size=4", "--trainer.callbacks=[{class_path: "
                          "moh_lightning.callbacks.EMAWeightAveraging, init_args: {decay: 0.997}}]"],
    "llm_stdlib_75.yaml": ["--data.init_args.batch_size=2", "--data.init_args.seq_len=64",
                           "--model.init_args.arch.depth=2"],
}


@pytest.mark.parametrize("config", list(TASKS))
@pytest.mark.slow
def test_no_step_reads_the_device_or_calls_a_collective_outside_the_logging_steps(run_dir, config):
    main(["fit", "--config", config, *TASKS[config], f"--trainer.max_steps={STEPS}", "--trainer.max_epochs=-1",
          "--trainer.limit_val_batches=0", "--trainer.val_check_interval=null", "--trainer.check_val_every_n_epoch=1",
          f"--trainer.log_every_n_steps={LOG_EVERY}", f"--head_load.log_every_n_steps={LOG_EVERY}",
          "--throughput.window_size=2", "--checkpoint.every_n_train_steps=1000", "--trainer.enable_progress_bar=true",
          "--trainer.callbacks+=test_host_reads.StepReads"])
    found, logging = StepReads.found, StepReads.logging_steps
    # The last step ends the run (a final checkpoint, the summary): left out with the logging steps.
    quiet = [step for step in found if step not in logging and step != STEPS - 1]
    assert logging and len(quiet) >= STEPS - len(logging) - 2, (sorted(found), sorted(logging))
    for step in quiet:
        reads, collectives = found[step]["reads"], found[step]["collectives"]
        assert not reads, f"step {step} read the device {len(reads)} times; the first:\n{reads[0]}"
        assert not collectives, f"step {step} called a collective:\n{collectives[0]}"


class SyncDebug(Callback):
    """torch's CUDA sync debug mode set to raise in every training step but the logging steps."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.set_sync_debug_mode(0 if compat.logs_this_step(trainer) else "error")

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", list(TASKS))
def test_no_step_waits_for_the_gpu_outside_the_logging_steps(run_dir, config):
    try:
        main(["fit", "--config", config, *TASKS[config], "--trainer.accelerator=gpu", "--trainer.max_steps=8",
              "--trainer.max_epochs=-1", "--trainer.limit_val_batches=0", "--trainer.val_check_interval=null",
              "--trainer.check_val_every_n_epoch=1", f"--trainer.log_every_n_steps={LOG_EVERY}",
              f"--head_load.log_every_n_steps={LOG_EVERY}", "--checkpoint.every_n_train_steps=1000",
              "--model.init_args.compile=false", "--trainer.callbacks+=test_host_reads.SyncDebug"])
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_moh_training_step_runs_under_cuda_graphs_with_its_head_load(run_dir):
    # reduce-overhead replays each compiled block as a CUDA graph: the gates the head-load counter reads and the
    # load-balance loss the task adds are taken within their step, before the next replay writes over them.
    main(["fit", "--config", "vit_tiny_mnist_75.yaml", "--data.init_args.batch_size=16", "--trainer.accelerator=gpu",
          "--trainer.max_steps=8", "--trainer.limit_val_batches=0", f"--trainer.log_every_n_steps={LOG_EVERY}",
          f"--head_load.log_every_n_steps={LOG_EVERY}", "--model.init_args.compile=auto",
          "--model.init_args.compile_kwargs={mode: reduce-overhead}", "--trainer.callbacks+=test_host_reads.StepReads"])
    loads = run_dir / "runs" / "vit_tiny_mnist_75" / "version_0" / "head_load" / "summary.md"
    assert loads.is_file() and "No routed head measured" not in loads.read_text()
