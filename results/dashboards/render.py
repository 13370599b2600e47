"""Renders the head-load dashboards of the three tasks in a real TensorBoard and a real (headless) browser.

Trains a short run of each task (MNIST ViT, MNIST DiT, a two-source language model on standard-library code) and the
ViT's dense baseline, scores the ViT's last checkpoint with ``moh validate``, starts ``tensorboard`` on each run folder
and on all of them together, and screenshots its tabs with Debian's ``chromium`` into
``results/dashboards/<task>_<view>.png``:

    OMP_NUM_THREADS=1 .venv/bin/python results/dashboards/render.py                 # ~25 minutes on 2 cores
    .venv/bin/python results/dashboards/render.py --workdir /tmp/moh_dash --reuse   # screenshots of existing runs

Needs ``apt-get install -y chromium``. The runs land in ``--workdir`` (a temporary folder by default), not here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from moh_lightning.callbacks.logger_runs import time_series_link

HERE = Path(__file__).resolve().parent
MOH = str(Path(sys.executable).with_name("moh"))
TENSORBOARD = str(Path(sys.executable).with_name("tensorboard"))
STDLIB = Path(json.__file__).resolve().parent.parent


def _lm_args() -> list[str]:
    sources = [{"path": str(STDLIB / "json"), "pattern": "*.py", "val_fraction": 0.3},
               {"path": str(STDLIB / "email"), "pattern": "*.py", "val_fraction": 0.3}]
    return ["--data.init_args.sources", json.dumps(sources), "--model.init_args.max_tokens", "200000",
            "--trainer.val_check_interval", "12", "--head_load.log_every_n_steps", "4"]


# task -> (config, run name, extra arguments): each a minute or two on two CPU cores.
RUNS = {
    "vit": ("vit_tiny_mnist_75", "vit_tiny_mnist_75", ["--trainer.max_epochs", "2"]),
    # The same config with plain multi-head attention: its run is named for it, beside the MoH run in HParams.
    "vit_dense": ("vit_tiny_mnist_75", "vit_tiny_mnist_dense",
                  ["--trainer.max_epochs", "2", "--model.init_args.arch.moh", "null"]),
    # Past the EMA's start (step 400): validation runs with the EMA weights, which before that are the initial ones.
    "dit": ("dit_mnist_90", "dit_mnist_90", ["--trainer.max_steps", "600", "--trainer.val_check_interval", "300"]),
    "lm": ("llm_stdlib_75", "llm_stdlib_75", _lm_args()),
}
SCREENSHOTS = ("vit", "dit", "lm")  # the dense baseline shows in the HParams table

# The cards `moh fit`'s closing link pins (train/loss and the metric its best checkpoint is chosen by; none for DiT).
PINNED = {"vit": ["train/loss", "val/acc1"], "lm": ["train/loss", "val/loss"]}
# view -> (URL fragment, window height): TensorBoard's own tabs, each at its default settings.
VIEWS = {
    "timeseries": ("#timeseries", 2400),
    "images": ("#images", 2400),
    "custom_scalars": ("#custom_scalars", 1800),
    "histograms": ("#histograms", 1800),
    "distributions": ("#distributions", 1800),
    "text": ("#text", 1800),
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _moh(workdir: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [MOH, *args, "--trainer.enable_progress_bar", "false"]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=workdir, env=env, check=True, stdout=subprocess.DEVNULL)


def train(workdir: Path, task: str) -> Path:
    config, name, extra = RUNS[task]
    _moh(workdir, "fit", "--config", f"{config}.yaml", *extra)
    return newest_run(workdir, name)


def evaluate(run: Path) -> None:
    """``moh validate`` of the run's last checkpoint: logged into ``<run>/eval/``, at the checkpoint's step."""
    _moh(run.parent.parent.parent, "validate", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))


def newest_run(workdir: Path, name: str) -> Path:
    versions = sorted((workdir / "runs" / name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    if not versions:
        raise SystemExit(f"no run named {name} under {workdir}/runs; run without --reuse")
    return versions[-1]


class TensorBoard:
    """A real ``tensorboard`` process on 127.0.0.1 and a free port, stopped on exit."""

    def __init__(self, logdir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([TENSORBOARD, "--logdir", str(logdir), "--host", "127.0.0.1", "--port",
                                         str(self.port), "--reload_interval", "1"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def get(self, route: str, data: dict | None = None):
        body = None if data is None else json.dumps(data).encode()
        request = urllib.request.Request(self.url + route, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def wait_for_images(self, timeout: float = 90.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.get("/data/plugin/images/tags") and self.get("/data/plugin/text/tags"):
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"TensorBoard at {self.url} served no images within {timeout:.0f} s")

    def __enter__(self) -> TensorBoard:
        return self

    def __exit__(self, *_) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


def screenshot(url: str, path: Path, height: int, profile: Path, width: int = 1400) -> None:
    """One headless Chromium screenshot of ``url``, after 20 s of virtual time for TensorBoard's requests."""
    command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--virtual-time-budget=20000", f"--screenshot={path}",
               f"--window-size={width},{height}", url]
    subprocess.run(command, check=True, timeout=180, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("wrote", path, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="folder for the runs (a temporary one by default)")
    parser.add_argument("--reuse", action="store_true", help="screenshot the newest runs already in --workdir")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--tasks", nargs="*", default=list(RUNS))
    parser.add_argument("--views", nargs="*", default=list(VIEWS))
    args = parser.parse_args()
    if shutil.which("chromium") is None:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="moh_dashboards_"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs = {task: newest_run(workdir, RUNS[task][1]) if args.reuse else train(workdir, task) for task in args.tasks}
    if "vit" in runs and not args.reuse:
        evaluate(runs["vit"])
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moh_chromium_") as profile:
        for task, run in runs.items():
            if task not in SCREENSHOTS:
                continue
            with TensorBoard(run) as board:
                board.wait_for_images()
                for view in args.views:
                    fragment, height = VIEWS[view]
                    screenshot(board.url + "/" + fragment, args.out / f"{task}_{view}.png", height, Path(profile))
                if task in PINNED:
                    screenshot(time_series_link(PINNED[task], board.url + "/"),
                               args.out / f"{task}_timeseries_pinned.png", 1400, Path(profile))
        with TensorBoard(workdir / "runs") as board:  # every task's run in one HParams table
            board.wait_for_images()
            screenshot(board.url + "/#hparams", args.out / "all_hparams.png", 700, Path(profile), width=2200)
    print("runs in", workdir)


if __name__ == "__main__":
    main()
