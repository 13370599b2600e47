"""The private Lightning and jsonargparse names moh_lightning relies on still exist, and only lightning_compat.py uses
them.

When this fails after an upgrade, a private name listed in
``moh_lightning.lightning_compat.PRIVATE_NAMES`` was renamed or removed: adapt the function
of lightning_compat.py that uses it (and the upper bound on lightning in pyproject.toml).
"""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, RichProgressBar
from lightning.pytorch.strategies import DDPStrategy

from moh_lightning import lightning_compat
from moh_lightning.callbacks import reliability, run_store, shutdown, watchdog
from moh_lightning.lightning_compat import PRIVATE_NAMES, MoHRichProgressBar
from moh_lightning.trainer_cli import MoHLightningCLI


def _resolve_owner(path: str) -> tuple[object, str]:
    """The object (module or class) that should hold the last name of ``path``, and that name."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            assert hasattr(owner, name), f"{path}: {owner!r} has no {name!r}"
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise AssertionError(f"{path}: no importable module in it")


@pytest.fixture(scope="module")
def instances(tmp_path_factory) -> list[object]:
    """Real objects of the classes whose instance attributes are listed: a tiny Trainer and its loops, a
    ModelCheckpoint, a DDP strategy."""
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, max_steps=1)
    return [trainer, trainer.fit_loop, trainer.fit_loop.epoch_loop,
            ModelCheckpoint(dirpath=tmp_path_factory.mktemp("ckpt")), DDPStrategy(), EMAWeightAveraging(),
            LightningModule()]


@pytest.mark.parametrize("path", PRIVATE_NAMES)
def test_private_lightning_name_exists(path: str, instances: list[object]) -> None:
    owner, name = _resolve_owner(path)
    if hasattr(owner, name):
        return
    if inspect.isfunction(owner):  # a private keyword of a public method
        assert name in inspect.signature(owner).parameters, f"{path}: {owner.__qualname__} takes no {name!r}"
        return
    # Attributes Lightning sets in __init__ exist on instances only.
    assert inspect.isclass(owner), f"{path}: {owner!r} has no {name!r}"
    objects = [obj for obj in instances if isinstance(obj, owner)]
    assert objects, f"{path}: no instance of {owner.__qualname__} to look on (the Trainer no longer uses it?)"
    assert all(hasattr(obj, name) for obj in objects), f"{path}: {owner.__qualname__} has no {name!r}"


def _private_names_used(module) -> set[str]:
    """Non-dunder names starting with ``_`` that ``module`` reads as attributes or imports from lightning."""
    tree = ast.parse(Path(module.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_every_private_name_used_by_the_compat_module_is_listed() -> None:
    listed = {path.rsplit(".", 1)[1] for path in PRIVATE_NAMES}
    unlisted = _private_names_used(lightning_compat) - listed
    assert not unlisted, f"lightning_compat.py uses {sorted(unlisted)}: list them in PRIVATE_NAMES"


def _private_names_defined(folder: Path) -> set[str]:
    """The private names a package defines: its functions, classes, attributes it assigns and keywords it takes."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(errors="replace"))):
            if isinstance(node, ast.ClassDef):
                found.add(node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.update([node.name, *(a.arg for a in [*node.args.args, *node.args.kwonlyargs])])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for part in ast.walk(target):
                        found.add(part.attr if isinstance(part, ast.Attribute) else getattr(part, "id", ""))
    return {n for n in found if n.startswith("_") and not n.startswith("__")}


def _private_names_read(path: Path) -> set[str]:
    """Private names a module reads as attributes, passes as keywords or imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


@pytest.mark.slow
def test_no_module_but_the_compat_module_uses_a_private_lightning_or_jsonargparse_name() -> None:
    """A private name Lightning or jsonargparse defines and the suite does not, read anywhere in the package outside
    lightning_compat.py, is a private use that no test would see change."""
    import jsonargparse
    import lightning

    package = Path(lightning_compat.__file__).parent
    ours = _private_names_defined(package)
    theirs = set().union(*(_private_names_defined(Path(m.__file__).parent) for m in (lightning, jsonargparse)))
    found = {f"{path.relative_to(package)}: {name}" for path in package.rglob("*.py")
             if path.name != "lightning_compat.py" for name in (_private_names_read(path) & theirs) - ours}
    assert found == set(), "use these through moh_lightning/lightning_compat.py"


@pytest.mark.parametrize("module", [reliability, shutdown, watchdog, run_store],
                         ids=lambda module: module.__name__.rpartition(".")[2])
def test_the_reliability_callbacks_use_no_private_lightning_name(module) -> None:
    listed = {path.rsplit(".", 1)[1] for path in PRIVATE_NAMES}
    used = _private_names_used(module) & listed
    assert not used, f"{module.__name__} uses {sorted(used)}: go through lightning_compat"
    tree = ast.parse(Path(module.__file__).read_text())
    private_imports = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").startswith("lightning") for alias in node.names
                       if alias.name.startswith("_")]
    assert not private_imports, "import private Lightning names in lightning_compat.py only"


@pytest.mark.parametrize("configured", [False, True])
def test_moh_labels_unlimited_epochs_unless_a_bar_is_configured(run_dir, configured) -> None:
    """Lightning's own Rich bar shows ``max_epochs: -1`` as "Epoch 0/-2"; `moh` puts the suite's in its place (its
    label: tests/tasks/test_language_model.py::test_progress_bar_counts_the_token_budget)."""
    bar = ["--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar"] if configured else []
    cli = MoHLightningCLI(args=["--config", "vit_tiny_mnist_75.yaml", "--trainer.logger", "false", *bar], run=False)
    assert type(cli.trainer.progress_bar_callback) is (RichProgressBar if configured else MoHRichProgressBar)


def test_bar_shows_the_last_validation_not_the_one_before(tmp_path) -> None:
    """The bar keeps the metrics of the last logging step between logging steps; a validation at an epoch's end
    comes after that step, so the bar must show its values, not those of the validation before (a run once ended on
    "val/acc1: 0.450" beside a summary of "final 0.425")."""
    import torch
    from lightning.pytorch import LightningModule

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def validation_step(self, batch, batch_idx):
            self.log("val/score", float(self.current_epoch), prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Recording(MoHRichProgressBar):
        shown_at_epoch_end: list[dict] = []

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            super().on_train_epoch_end(trainer, pl_module)
            self.shown_at_epoch_end.append(self.get_metrics(trainer, pl_module))

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(5, 2)), batch_size=1)
    bar = Recording()
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, max_epochs=3,
                      log_every_n_steps=10, num_sanity_val_steps=0, enable_model_summary=False, callbacks=[bar])
    trainer.fit(Tiny(), loader, loader)
    assert [shown.get("val/score") for shown in bar.shown_at_epoch_end] == [0.0, 1.0, 2.0]


def test_bar_counting_steps_tells_real_time_across_epochs_validations_and_a_resume(tmp_path) -> None:
    """A DiT run once read "1163/2000 0:00:15 • 0:00:01 3670.26it/s" after eight minutes: Lightning's bar restarted
    its clock at each epoch, and went back to the epoch's batch before the bar went to the run's step, which counted
    every step so far as made at once."""
    import time

    import torch

    step_seconds = 0.02

    class Slow(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(step_seconds)
            return self.layer(batch[0]).sum()

        def validation_step(self, batch, batch_idx):
            time.sleep(step_seconds)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen: list[tuple[int, float, float | None, float]] = []

    class Look(MoHRichProgressBar):
        def on_train_batch_end(self, trainer, *args) -> None:
            super().on_train_batch_end(trainer, *args)
            task = self.progress.tasks[self.train_progress_bar_id]
            seen.append((int(task.completed), task.start_time, task.speed, trainer.global_step))

    def fit(max_steps: int, ckpt_path: str | None = None) -> Trainer:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(3, 2)), batch_size=1)
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, max_epochs=-1,
                          max_steps=max_steps, num_sanity_val_steps=0, enable_model_summary=False,
                          callbacks=[Look()], default_root_dir=tmp_path)
        trainer.fit(Slow(), loader, loader, ckpt_path=ckpt_path)  # 3 steps an epoch, a validation after each
        return trainer

    trainer = fit(12)
    trainer.save_checkpoint(tmp_path / "step12.ckpt")
    first = list(seen)
    seen.clear()
    fit(20, str(tmp_path / "step12.ckpt"))
    for run, start in ((first, 0), (seen, 12)):
        assert [completed for completed, *_ in run] == [step for *_, step in run] == list(range(start + 1,
                                                                                             start + len(run) + 1))
        assert len({started for _, started, _, _ in run}) == 1  # one clock over the epochs: elapsed since the start
        speeds = [speed for _, _, speed, _ in run if speed is not None]
        assert speeds and max(speeds) < 1.2 / step_seconds, speeds  # never faster than a step can be
