"""Throughput and MFU: samples/s and tokens/s logged in training, FLOPs counted for the dense model (causal attention
at half its square) and for the heads a head-sparse layer actually computes."""
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from moh_lightning.callbacks import MoHThroughputMonitor
from moh_lightning.callbacks.throughput import sample_flops
from moh_lightning.layers import MoHAttention


class TinyTask(LightningModule):
    """Two MoH layers over 96 tokens: one causal, one bidirectional."""

    def __init__(self, execution: str = "masked") -> None:
        super().__init__()
        self.model = torch.nn.ModuleList([
            MoHAttention(32, 8, num_shared_heads=2, top_k=2, causal=True, execution=execution),
            MoHAttention(32, 8, num_shared_heads=2, top_k=4, execution=execution)])

    @property
    def example_input_array(self) -> torch.Tensor:
        return torch.zeros(1, 96, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model:
            x = x + layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _counted(task: TinyTask) -> tuple[float, list[float]]:
    """Total FLOPs of one sample's forward and backward, every head computed, and each layer's attention core."""
    for layer in task.model:
        layer.execution = "masked"
    with FlopCounterMode(display=False) as counter:
        task(task.example_input_array).sum().backward()
    counts = counter.get_flop_counts()
    cores = [sum(flops for op, flops in counts[f"TinyTask.model.{i}"].items() if "scaled_dot_product" in str(op))
             for i in range(2)]
    return counter.get_total_flops(), cores


@pytest.mark.parametrize("execution", ["masked", "sparse"])
def test_sample_flops_halve_causal_attention_and_count_only_computed_heads(execution):
    torch.manual_seed(0)
    task = TinyTask(execution)
    flops = sample_flops(task)
    assert [layer.execution for layer in task.model] == [execution] * 2      # restored after counting
    total, (causal_core, core) = _counted(TinyTask("masked"))
    assert causal_core > 0 and core > 0, "the attention cores were not counted"
    assert flops.dense == pytest.approx(total - 0.5 * causal_core)
    if execution == "masked":
        assert flops.computed == flops.dense
    else:   # the causal layer computes 2 + 2 of 8 heads, the other 2 + 4
        assert flops.computed == pytest.approx(total - causal_core * (1 - 0.5 * 4 / 8) - core * (1 - 6 / 8))
    assert flops.tokens == 96


def test_training_logs_samples_tokens_and_both_mfus(tmp_path):
    torch.manual_seed(0)
    task = TinyTask("sparse")
    data = DataLoader(TensorDataset(torch.randn(24, 96, 32)), batch_size=4)
    monitor = MoHThroughputMonitor(available_flops=1e12, window_size=2)
    trainer = Trainer(max_steps=6, log_every_n_steps=2, logger=CSVLogger(tmp_path), callbacks=[monitor],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu")
    trainer.fit(task, data)
    import csv

    rows = list(csv.DictReader(open(trainer.logger.experiment.metrics_file_path)))
    logged = [row for row in rows if row.get("throughput/samples_per_sec")]
    assert logged, f"no throughput row in {rows}"
    last = {key: float(value) for key, value in logged[-1].items() if value}
    assert last["throughput/tokens_per_sec"] == pytest.approx(96 * last["throughput/samples_per_sec"])
    ratio = monitor.flops.computed / monitor.flops.dense
    assert 0 < ratio < 1
    assert last["throughput/mfu_computed"] == pytest.approx(ratio * last["throughput/mfu_dense"], rel=1e-6)
    assert last["throughput/mfu_dense"] == pytest.approx(last["throughput/flops_per_sec_dense"] / 1e12, rel=1e-6)


def test_a_run_shorter_than_the_window_and_the_logging_interval_still_logs_its_throughput(tmp_path):
    task = TinyTask("masked")
    data = DataLoader(TensorDataset(torch.randn(24, 96, 32)), batch_size=4)
    trainer = Trainer(max_steps=5, log_every_n_steps=50, logger=CSVLogger(tmp_path),
                      callbacks=[MoHThroughputMonitor(available_flops=1e12, window_size=100)],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu")
    trainer.fit(task, data)
    import csv

    rows = list(csv.DictReader(open(trainer.logger.experiment.metrics_file_path)))
    assert [row["step"] for row in rows if row.get("throughput/samples_per_sec")] == ["5"]


@pytest.mark.parametrize("name, dtype, expected", [("NVIDIA H200", torch.bfloat16, 989.4e12),
                                                   ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
                                                   ("NVIDIA H200 NVL", torch.bfloat16, 835.5e12),
                                                   ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12)])
def test_mfu_uses_each_gpus_dense_peak(monkeypatch, name, dtype, expected):
    from moh_lightning.callbacks.throughput import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda"), dtype) == pytest.approx(expected)
    assert peak_flops(torch.device("cpu"), dtype) is None


def test_a_window_of_one_batch_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"^throughput.window_size=1: "):
        MoHThroughputMonitor(window_size=1)
