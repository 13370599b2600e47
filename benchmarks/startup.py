"""``python benchmarks/startup.py``: how long ``moh`` takes to answer, against ``python -c "import torch"``.

Each command runs as a fresh process ``repeats`` times, one after another, and the page gives the median and the range
of its wall time: ``moh --help``, a Trainer loop's and a tool's ``--help``, ``from moh_lightning import MoHAttention``,
and ``moh fit`` on the embedded ViT default up to the end of its first training step (``max_steps 1``, no
validation, no progress bar; the run folder goes to a temporary folder). For that fit the page also gives the imports'
own share, the sum of ``python -X importtime``'s top-level cumulative times in one more run. ``--pythonpath`` measures
another checkout of the suite with this environment's packages (the code before a change, say).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jsonargparse import CLI

MOH = "import sys; from moh_lightning.cli import main; main()"
FIT = ["fit", "--config", "vit_tiny_mnist_75.yaml", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
       "--trainer.enable_progress_bar", "false"]
COMMANDS = {
    'python -c "import torch"': ["-c", "import torch"],
    "moh --help": ["-c", MOH, "--help"],
    "moh fit --help": ["-c", MOH, "fit", "--help"],
    "moh sample --help": ["-c", MOH, "sample", "--help"],
    "from moh_lightning import MoHAttention": ["-c", "from moh_lightning import MoHAttention"],
    "moh fit (embedded ViT) to its first step": ["-c", MOH, *FIT],
}


def _run(args: list[str], env: dict[str, str], cwd: str, importtime: bool = False) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *(["-X", "importtime"] if importtime else []), *args], env=env, cwd=cwd,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"startup: {args[-1]} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return seconds, done.stderr


def _import_seconds(report: str) -> float:
    """The sum of the top-level imports' cumulative times in a ``-X importtime`` report."""
    rows = [line.split("|") for line in report.splitlines() if line.startswith("import time:")]
    return sum(int(cumulative) for _, cumulative, name in rows[1:] if not name.startswith("  ") and name.strip()) / 1e6


def bench(repeats: int = 5, pythonpath: str | None = None, label: str = "this checkout",
          output: str | None = None) -> str:
    """Times ``moh``'s start-up commands and writes a markdown table (printed, and to ``output`` when given).

    Args:
        repeats: Runs of each command; the median and the range are reported.
        pythonpath: A checkout of the suite to import instead of the installed one (put first on ``PYTHONPATH``).
        label: What the table measured, its heading.
        output: Markdown file to append the table to.
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])
    lines = [f"### {label}", "", f"{repeats} runs each, {time.strftime('%Y-%m-%d %H:%M')}, load average before: "
             f"{os.getloadavg()[0]:.1f}", "", "| command | median s | range s | / import torch |", "|---|---|---|---|"]
    torch_median = None
    with tempfile.TemporaryDirectory() as folder:
        env["HOME"] = folder  # fresh caches, as a new user's
        for name, args in COMMANDS.items():
            seconds = [_run(args, env, folder)[0] for _ in range(repeats)]
            median = statistics.median(seconds)
            torch_median = torch_median or median
            lines.append(f"| `{name}` | {median:.2f} | {min(seconds):.2f}-{max(seconds):.2f} | "
                         f"{median / torch_median:.2f}x |")
            print(lines[-1], flush=True)
        imports = _import_seconds(_run(COMMANDS["moh fit (embedded ViT) to its first step"], env, folder, True)[1])
    lines += ["", f"Imports of that `moh fit` (`python -X importtime`, top-level cumulative): {imports:.2f} s.", ""]
    page = "\n".join(lines)
    if output:
        with Path(output).open("a") as file:
            file.write(page + "\n")
    print(page)
    return page


if __name__ == "__main__":
    CLI(bench, as_positional=False)
