"""The suite's EMAWeightAveraging keeps Lightning's average (its schedule, first copy and checkpoint state) while
updating it in one fused call that never reads the device."""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import EMAWeightAveraging as LightningEMA
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from moh_lightning.callbacks import EMAWeightAveraging


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=generator),
                                        torch.randn(64, 1, generator=generator)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _fit(callback, tmp_path, max_steps: int = 7, ckpt_path=None) -> Trainer:
    seed_everything(0)
    trainer = Trainer(max_steps=max_steps, callbacks=[callback], logger=False, default_root_dir=tmp_path,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Tiny(), ckpt_path=ckpt_path)
    return trainer


def _average(callback) -> list[torch.Tensor]:
    module = callback._average_model.module
    return [t.clone() for t in (*module.parameters(), *module.buffers())]


@pytest.mark.parametrize("start", [None, 3])
def test_the_fused_average_is_lightnings(tmp_path, start):
    ours, theirs = EMAWeightAveraging(decay=0.9, update_starting_at_step=start), \
        LightningEMA(decay=0.9, update_starting_at_step=start)
    _fit(ours, tmp_path / "ours")
    _fit(theirs, tmp_path / "theirs")
    assert int(ours._average_model.n_averaged) == int(theirs._average_model.n_averaged) == (7 if start is None else 4)
    for mine, lightning in zip(_average(ours), _average(theirs), strict=True):
        torch.testing.assert_close(mine, lightning, rtol=1e-6, atol=1e-7)


def test_a_resumed_average_continues_as_lightnings_does(tmp_path):
    # Whether the first update copies is read from the restored latest_update_step, not from the device's counter.
    averages = []
    for kind in (EMAWeightAveraging, LightningEMA):
        folder = tmp_path / kind.__module__
        first = _fit(kind(decay=0.9), folder, max_steps=4)
        first.save_checkpoint(folder / "part.ckpt")
        resumed = kind(decay=0.9)
        _fit(resumed, folder, ckpt_path=str(folder / "part.ckpt"))
        assert int(resumed._average_model.n_averaged) == 7
        averages.append(_average(resumed))
    for mine, lightning in zip(*averages, strict=True):
        torch.testing.assert_close(mine, lightning, rtol=1e-6, atol=1e-7)


def test_an_update_reads_nothing_from_the_device(tmp_path):
    callback = EMAWeightAveraging(decay=0.9)
    trainer = _fit(callback, tmp_path, max_steps=2)
    module = trainer.lightning_module
    for first in (True, False):
        with _Reads() as mode:
            callback._update(module, first=first)
        assert mode.reads == 0


def test_a_run_that_does_not_shard_hears_no_sharding_warning(tmp_path, recwarn):
    """A single-CPU DiT run once warned that WeightAveraging "may run out of memory": Lightning says so of any task
    with a ``configure_model`` (every task of the suite's), and it is true only where the strategy shards the model."""
    from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy

    from moh_lightning.callbacks.ema import shards_the_model

    class Configured(Tiny):
        def configure_model(self) -> None:
            pass

    seed_everything(0)
    trainer = Trainer(max_steps=2, callbacks=[EMAWeightAveraging()], logger=False, default_root_dir=tmp_path,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Configured())
    assert not [w for w in recwarn if "may run out of memory" in str(w.message)]
    with pytest.warns(UserWarning, match="may run out of memory"):  # Lightning's own still says it
        Trainer(max_steps=1, callbacks=[LightningEMA()], logger=False, default_root_dir=tmp_path,
                enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(Configured())
    assert shards_the_model(FSDPStrategy()) and not shards_the_model(SingleDeviceStrategy("cpu"))
