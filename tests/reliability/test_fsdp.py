"""`moh fit --config fsdp.yaml` on two CPU processes (gloo): every task trains sharded with norm gradient clipping
over all shards and non-empty weight-decay groups, and its checkpoint loads on one process.

Lightning's FSDPStrategy refuses CPU, so the shipped overlay's class is swapped for ``cpu_fsdp.CPUFSDPStrategy``,
which only wraps with ``device_id=cpu``; its settings (auto-wrap policy, ``use_orig_params``, full-state
checkpoints) are the overlay's.
"""
import importlib
import json
import math
import os
import socket
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cpu_fsdp import CPUFSDPStrategy
from ddp_cases import DDP_TASKS, DIT_SHRUNK, logged_scalars, write_text_corpus
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from moh_process import start
from timm.optim import param_groups_weight_decay
from tiny_models import dit_t4_config, tiny_llama_config
from torch import nn

from moh_lightning.callbacks.sample_grid import SampleGridCallback
from moh_lightning.callbacks.throughput import sample_flops
from moh_lightning.cli import main
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.llama import MoHLlama
from moh_lightning.models.vit import ViTConfig, create_vit
from moh_lightning.tasks import TASKS
from moh_lightning.tasks.base import DECAYED_LAYERS, weight_decay_groups
from moh_lightning.tasks.classification import ImageClassifier
from moh_lightning.tasks.diffusion import ClassConditionalDiffusion
from moh_lightning.tasks.language_model import LanguageModel

CLIP = 1e-3  # far below the gradient norms of these runs, so every step is clipped


def _global_grad_norm(model: nn.Module) -> float:
    """The 2-norm of the whole gradient: each rank holds the gradient of its shard only."""
    squares = sum((p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None), torch.zeros(()))
    dist.all_reduce(squares)
    return squares.sqrt().item()


class FSDPProbe(Callback):
    """Test helper loaded by the `moh fit` processes: each rank writes the world size, its weight-decay group sizes
    (elements of its shard) and each step's global gradient norm before and after clipping to ``probe<rank>.json``."""

    def __init__(self) -> None:
        self.world_size = 0
        self.groups: list[tuple[float, int]] = []
        self.norms: list[tuple[float, float]] = []
        self._before = math.nan

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.world_size = trainer.world_size
        self.groups = [(group["weight_decay"], sum(p.numel() for p in group["params"]))
                       for group in trainer.optimizers[0].param_groups]

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._before = _global_grad_norm(trainer.strategy.model)  # Lightning clips right after this hook

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.norms.append((self._before, _global_grad_norm(trainer.strategy.model)))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        Path(f"probe{trainer.global_rank}.json").write_text(json.dumps({"world_size": self.world_size,
                                                                         "groups": self.groups, "norms": self.norms}))


def _fit_each(runs: list[tuple[Path, list[str]]]) -> None:
    for folder, args in runs:
        os.chdir(folder)
        main(args)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _fit_every_task(root: Path) -> None:
    runs = []
    for task, (_, config, overrides) in FSDP_TASKS.items():
        (root / task).mkdir()
        if task == "language_model":
            write_text_corpus(root / task / "corpus")
        runs.append((root / task, [
            "fit", "--config", f"{config}.yaml", "--config", "fsdp.yaml",
            "--trainer.strategy.class_path=cpu_fsdp.CPUFSDPStrategy", "--trainer.accelerator=cpu",
            "--trainer.devices=2", "--trainer.precision=32-true", "--trainer.max_steps=3",
            "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", *overrides,
            f"--trainer.gradient_clip_val={CLIP}", "--trainer.callbacks+=test_fsdp.FSDPProbe",
            "--throughput.window_size=2"]))
    # Every task's `moh fit` one after another in the same 2 processes, forked from this one with an external
    # launcher's environment (LOCAL_RANK and the rest, as torchrun sets them), so Lightning launches none and each
    # task's fit joins the process group of the first.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "NODE_RANK": "0"}
    # DiT's training step imports diffusers.training_utils (seconds): imported here once, not in each rank.
    importlib.import_module("diffusers.training_utils")
    ranks = [start(partial(_fit_each, runs), root, {**env, "LOCAL_RANK": str(rank), "RANK": str(rank)},
                   stdout=root / f"out{rank}.txt", stderr=root / f"err{rank}.txt") for rank in (0, 1)]
    try:
        codes = [rank.wait(timeout=600) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert codes == [0, 0], (root / "err0.txt").read_text()[-3000:] + (root / "err1.txt").read_text()[-3000:]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    _fit_every_task(root)
    return root


# The DDP test's shrunk configs; DiT without its EMA and sample-grid callbacks, which FSDP cannot run (below), so
# with the always-on callbacks alone (head-load dashboards, checkpoints with last.ckpt).
FSDP_TASKS = {
    "classification": (ImageClassifier, *DDP_TASKS["classification"]),
    "diffusion": (ClassConditionalDiffusion, "dit_mnist_90", [*DIT_SHRUNK, "--trainer.callbacks=[]"]),
    "language_model": (LanguageModel, *DDP_TASKS["language_model"]),
}


def _ids(groups: list[dict]) -> list[set[int]]:
    return [{id(p) for p in group["params"]} for group in sorted(groups, key=lambda group: -group["weight_decay"])]


def test_weight_decay_by_layer_type_equals_the_shape_rules_on_unsharded_models():
    # The rules the tasks used before FSDP: timm's for the ViT, matrices and embeddings for the decoder.
    vit = create_vit(ViTConfig(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=6, num_classes=5,
                               moh=MoHConfig(num_shared_heads=2, top_k=2), qk_norm=True))
    timm_rule = param_groups_weight_decay(vit, 0.05, no_weight_decay_list=vit.no_weight_decay())
    assert _ids(weight_decay_groups(vit, 0.05)) == _ids(timm_rule)
    for tied in (True, False):
        llm = MoHLlama(tiny_llama_config("tiny_75", tie_embeddings=tied))
        shape_rule = [{"params": [p for p in llm.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                      {"params": [p for p in llm.parameters() if p.ndim < 2], "weight_decay": 0.0}]
        assert _ids(weight_decay_groups(llm, 0.1)) == _ids(shape_rule)


@pytest.mark.distributed
@pytest.mark.parametrize("task", TASKS)  # a registered task with no case here fails
def test_moh_fit_trains_every_task_under_lightning_fsdp_with_two_cpu_processes(task, fsdp_runs):
    task_class = FSDP_TASKS[task][0]
    run_dir = fsdp_runs / task
    probes = [json.loads((run_dir / f"probe{rank}.json").read_text()) for rank in (0, 1)]
    assert [probe["world_size"] for probe in probes] == [2, 2]

    # FSDP's clip_grad_norm_ scales both ranks' shards by one factor from the global norm, so the whole gradient
    # ends at the clip value (clipping each shard by its own norm would leave up to sqrt(2) x CLIP).
    assert probes[0]["norms"] == probes[1]["norms"] and len(probes[0]["norms"]) == 3
    for before, after in probes[0]["norms"]:
        assert before > 10 * CLIP and after == pytest.approx(CLIP, rel=1e-3)

    checkpoint = next(run_dir.rglob("last.ckpt"))
    # Full-state checkpoint: loads on one process; its decayed weights are exactly the elements that both
    # ranks' decay groups held, so no weight fell into the no-decay group by its flat shard shape.
    loaded = task_class.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=False)
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 3
    assert all(torch.isfinite(value.float()).all() for value in loaded.state_dict().values())
    decay_rate = loaded.hparams.weight_decay
    decayed = {id(m.weight): m.weight.numel() for m in loaded.model.modules() if isinstance(m, DECAYED_LAYERS)}
    decay = [sum(size for rate, size in probe["groups"] if rate > 0) for probe in probes]
    no_decay = [sum(size for rate, size in probe["groups"] if rate == 0) for probe in probes]
    if decay_rate > 0:
        assert sum(decay) == sum(decayed.values()) and sum(no_decay) > 0 and min(decay) > 0
    else:  # DiT trains without weight decay
        assert sum(decay) == 0

    run = next(run_dir.rglob("version_0"))  # the config's TensorBoard run
    losses = logged_scalars(run, "train/loss")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(v) for v in logged_scalars(run, "val/loss"))
    # The throughput meter counts a sample's FLOPs through the FSDP root on every rank: the same count as the
    # unsharded model's on one process (before, under FSDP it counted none, and logged no FLOP/s nor MFU).
    flops = logged_scalars(run, "throughput/flops_per_sec_dense")
    samples = logged_scalars(run, "throughput/samples_per_sec")
    assert len(flops) == 2 and [f / n for f, n in zip(flops, samples, strict=True)] == \
        pytest.approx([sample_flops(loaded).dense] * 2, rel=1e-4)


@pytest.mark.parametrize("callback", [EMAWeightAveraging(), SampleGridCallback()], ids=lambda c: type(c).__name__)
def test_fsdp_refuses_the_callbacks_that_need_the_whole_model_before_training(callback):
    """dit_mnist_90 as shipped keeps EMA weights and samples grids on rank 0; under FSDP each fit stops before its
    first step (the task's ``on_fit_start``, the callback's ``setup``), with a line that says what to do."""
    trainer = Trainer(strategy=CPUFSDPStrategy(), accelerator="cpu", devices=2, callbacks=[callback], logger=False,
                      enable_checkpointing=False)
    task = ClassConditionalDiffusion(dit_t4_config(depth=1, input_size=4, in_chans=2, num_classes=2))
    task.trainer = trainer
    with pytest.raises(ValueError, match="support FSDP|FSDP's sharded model cannot") as stop:
        callback.setup(trainer, task, "fit")
        task.on_fit_start()
    assert "--trainer.strategy ddp" in str(stop.value) and "\n" not in str(stop.value)
