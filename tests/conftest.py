import contextlib
import gc
import importlib
import io
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

# Two threads at most: the suite runs on a 2-core CI machine, and under pytest-xdist the cores are shared out among its
# workers (two workers on two cores: one thread each, for torch here and for the processes a test starts), since
# torch's threads spin-wait and two workers of two threads each on two cores run slower than one thread each.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads(), (os.cpu_count() or 1) // _WORKERS)))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A full garbage collection every 7,000 x 10 x 10 allocations, not every 700 x 10 x 10: a worker holds torch,
# Lightning, transformers and every test's models, and CPython's default thresholds spent about a tenth of the
# in-process tests' time walking them (measured with gc.callbacks on tests/models and tests/layers: 35 s -> 30 s).
# Cycles are still collected, a few times per test module.
CPYTHON_GC_THRESHOLDS = gc.get_threshold()
gc.set_threshold(7000, 10, 10)


def pythonpath(test_file: str) -> str:
    """PYTHONPATH for a ``moh`` subprocess that loads callbacks from the test module ``test_file``: its folder, this
    one (the helpers it imports) and the caller's own."""
    folders = [str(Path(test_file).parent), str(Path(__file__).parent), os.environ.get("PYTHONPATH")]
    return os.pathsep.join(folder for folder in folders if folder)


def ctrl_c_restored() -> None:
    """A child's ``preexec_fn``: SIGINT back to its default. A job started in the background (``bash .ci/run &``,
    ``nohup``) ignores SIGINT, and so would the ``moh`` run a test stops with it, as such a run rightly does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# The session's one shared training run (two DDP processes): its tests run on one worker, which builds it once.
SHARED_RUN = "vit_ddp_uninterrupted"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns each xdist_group mark into the test's group
def pytest_collection_modifyitems(items) -> None:
    """Distributed and server tests are slow as well, so that ``-m "not slow"`` leaves them out.

    Under pytest-xdist (``--dist loadgroup``) the tests that share a module-scoped fixture (a trained checkpoint, an
    uninterrupted reference run, a server) run on one worker, which builds it once; the others are handed out one by
    one. A test marked ``xdist_group`` itself keeps its own group. The workers take tests in collection order, so the
    modules with the longest tests come first (the Ray sweeps, one worker's run of several modules; then servers and
    several processes; then slow tests): started last, one of them would leave the other worker idle at the end of the
    run. A module's tests stay together, in their own order, so that its module-scoped fixtures are built once."""
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("server"):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("xdist_group"):
            continue
        if _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        elif SHARED_RUN in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(SHARED_RUN))  # built once for the modules that compare with it
    rank: dict[str, int] = {}
    for item in items:
        group = item.get_closest_marker("xdist_group")
        cost = 0 if group and group.args == ("ray",) else \
            1 if item.get_closest_marker("server") or item.get_closest_marker("distributed") else \
            2 if item.get_closest_marker("slow") else 3
        rank[item.fspath] = min(rank.get(item.fspath, 3), cost)
    items.sort(key=lambda item: rank[item.fspath])  # stable: each module's own order kept
    if items and getattr(items[0].config.option, "loadgroup", False):  # set on an xdist worker with --dist loadgroup
        _group_ids(items)


def _group_ids(items) -> None:
    """The ``@group`` suffix of each grouped test's id, by which pytest-xdist's scheduler keeps a group on one worker.

    pytest-xdist 3.8 writes it into ``item._nodeid``, which pytest 9.2 no longer reads (a node's id is ``item._id``):
    without this, every group is silently spread over both workers. Done here as xdist's own hook would."""
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def _uses_module_fixture(item) -> bool:
    """Whether ``item`` uses a fixture of its own module that lives longer than a test."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    module = getattr(item, "module", None)
    return any(definitions[-1].scope in ("module", "class", "package", "session")
               and getattr(definitions[-1].func, "__module__", None) == getattr(module, "__name__", "")
               for definitions in info.name2fixturedefs.values())


@pytest.fixture(scope="session")
def vit_ddp_uninterrupted(tmp_path_factory) -> Path:
    """The exact-resume ViT run uninterrupted on 2 DDP ranks: the reference of the run that lost a node and resumed
    (test_run_shutdown.py)."""
    from exact_runs import VIT_DDP, fit

    folder = tmp_path_factory.mktemp("vit_ddp") / "uninterrupted"
    fit(folder, *VIT_DDP)
    return folder


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """An empty working folder, so relative run folders land in tmp and shipped configs resolve by name."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def mlflow_uri_unset():
    """MLflow's tracking URI as a fresh process has it: an MLFlowLogger sets it for its whole process (and that
    process's environment), where the next test's logger would take it as the default."""
    import mlflow

    mlflow.set_tracking_uri(None)
    yield
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="session")
def _empty_mlflow_store(tmp_path_factory) -> Path:
    """An MLflow sqlite store with its tables and nothing else, made once: MLflow makes a new store's tables by running
    every one of its migrations, seconds each time (tens on a loaded machine)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_store(_empty_mlflow_store):
    """Puts an empty MLflow sqlite store at a path (a file MLflow would otherwise make with its first run there);
    returns its tracking URI."""
    def place(path: Path) -> str:
        shutil.copyfile(_empty_mlflow_store, path)
        return f"sqlite:///{path}"
    return place


@pytest.fixture
def write_image_folder():
    """Writes random PNGs in ImageNet's layout (root/{train,val}/{cat,dog}/i.png)."""
    def write(root, per_class: int = 4, size: tuple[int, int] = (40, 48)) -> None:
        rng = np.random.default_rng(0)
        for split in ("train", "val"):
            for label in ("cat", "dog"):
                folder = root / split / label
                folder.mkdir(parents=True)
                for i in range(per_class):
                    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return write


def run_checkpoints(name: str, root: str | Path = ".") -> Path:
    """The ``checkpoints/`` folder of the newest run folder ``<root>/runs/<name>/version_N/`` that has one."""
    versions = sorted((Path(root) / "runs" / name).glob("version_*/checkpoints"),
                      key=lambda folder: int(folder.parent.name.removeprefix("version_")))
    assert versions, f"no checkpoints under {Path(root) / 'runs' / name}/version_*/"
    return versions[-1]


def printed_config(args: list[str]) -> dict:
    """The complete config ``moh fit <args> --print_config`` prints, as a dict."""
    from moh_lightning.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None), exit_info.value.code
    return yaml.safe_load(out.getvalue())


def class_of(class_path: str) -> type:
    """The class a config's ``class_path`` names (a config may name it through a re-exporting package)."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)
