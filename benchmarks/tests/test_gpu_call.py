"""``benchmarks/run.sh``, the one call on a lent GPU, proven here where a mistake costs nothing: its dry run on the
CPU (the same phases, tiny shapes, compiled rows through aot_eager, the wheels' names checked against fake wheels,
the CUDA tests collected), and the checks of ``benchmarks/wheels.py`` that make and install the wheels."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks import wheels

RUN = Path(wheels.__file__).with_name("run.sh")
PHASES = ("setup", "check", "steps", "loader", "tests")


def fake_wheels(folder: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """Empty files named as ``python benchmarks/wheels.py`` names the wheels: what the dry run checks of them."""
    folder.mkdir()
    for name, pinned in wheels.read_list(wheels.NAMES).items():
        if name not in leave_out:
            (folder / f"{name.replace('-', '_')}-{pinned or '0'}-py3-none-any.whl").touch()
    return folder


def dry_run(tmp_path: Path, fakes: Path) -> tuple[int, Path, str]:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "MOH_GPU_WHEELS": str(fakes), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["bash", str(RUN), "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    log = (out / "run.log").read_text()
    assert result.stdout == log  # the whole log, tee'd
    return result.returncode, out, log


@pytest.mark.slow
def test_dry_run_runs_every_phase_and_writes_eager_and_compiled_rows(tmp_path):
    code, out, log = dry_run(tmp_path, fake_wheels(tmp_path / "wheels"))
    assert code == 0, log[-8000:]
    for phase in PHASES:
        assert re.search(rf"^== {phase}: exit 0 after \d+ s; \d+ s left of 540$", log, re.M), phase
    assert "wheels: dry run: the 10 wheels of wheels.txt are all in" in log
    # What a fresh process importing the call's modules reaches beyond the image, all carried; and jsonargparse left
    # out of wheels.txt would be missed (the check's own computation, on the distributions the check found).
    needed = set(re.search(r"^check: .* what the call imports beyond the image is carried: (.*)$", log, re.M)[1]
                 .split(", "))
    assert {"jsonargparse", "docstring-parser", "typeshed-client", "torchdata", "torch-fidelity"} <= needed
    carried, image = wheels.read_list(wheels.NAMES), wheels.read_list(wheels.IMAGE)
    assert needed <= set(carried)
    assert wheels.needed_distributions(wheels.suite_requirements(), needed, image, carried) == needed
    del carried["jsonargparse"]
    assert wheels.needed_distributions(wheels.suite_requirements(), needed, image, carried) - set(carried) == {
        "jsonargparse"}
    rows = json.loads((out / "steps.json").read_text())
    # The dry run's one pair (the other tasks' rows, eager and compiled, are test_steps.py's).
    assert sorted((r["config"], r["asked_compile"]) for r in rows) == [("vit_tiny_mnist_75", False),
                                                                       ("vit_tiny_mnist_75", True)]
    for row in rows:
        graphs = (row["moh_graphs"], row["baseline_graphs"])
        if row["asked_compile"]:  # compiled for real: each network's blocks compiled graphs
            assert row["compile"] is True and min(graphs) > 0 and row["compile_backend"] == "aot_eager", row
        else:
            assert row["compile"] is False and graphs == (0, 0), row
        assert row["device"] == "cpu" and row["batch"] == 2 and "torch" in row["versions"]
    loader = json.loads((out / "loader.json").read_text())
    assert sorted((r["device_augment"], r["workers"]) for r in loader) == [(False, 0), (True, 0)]
    assert re.search(r"^=+ \d+ skipped in ", log, re.M)  # the CUDA tests collected, and skipped on the CPU
    assert "Traceback" not in log
    # What the device tool brings back: at most 8 files, named in letters, digits, '.', '_' and '-'.
    names = sorted(path.name for path in out.iterdir())
    assert names == ["loader.json", "loader.md", "run.log", "steps.json", "steps.md"]


def test_a_missing_wheel_ends_the_call_before_it_measures(tmp_path):
    code, out, log = dry_run(tmp_path, fake_wheels(tmp_path / "wheels", leave_out=("liger-kernel",)))
    assert code == 1
    assert "liger-kernel: no wheel in" in log and "== setup: exit 1" in log
    assert "== steps" not in log and not (out / "steps.json").exists()


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (), tag: str = "py3-none-any") -> None:
    stem = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{stem}-{tag}.whl", "w") as archive:
        archive.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                         + "".join(f"Requires-Dist: {requirement}\n" for requirement in requires))


def test_the_wheel_set_check_names_what_is_missing_doubled_unmet_or_for_another_python(tmp_path):
    _wheel(tmp_path, "alpha", "1.0", ("beta>=2", "torch>=3", "numpy; python_version < '3'", "gamma; extra == 'x'",
                                      "zeta"))
    _wheel(tmp_path, "beta", "1.5")
    _wheel(tmp_path, "delta", "1.0")
    _wheel(tmp_path, "delta", "2.0")
    _wheel(tmp_path, "omega", "1.0", tag="cp311-cp311-manylinux_2_17_x86_64")
    _wheel(tmp_path, "stray", "1.0")
    wanted = {"alpha": None, "beta": "1.5", "delta": None, "epsilon": None, "omega": None}
    problems = wheels.check_set(tmp_path, wanted, {"torch": "2.11.0", "numpy": None}, wheels.target_tags())
    assert problems == [
        f"delta: 2 wheels in {tmp_path}/ (delta-1.0-py3-none-any.whl, delta-2.0-py3-none-any.whl); keep one",
        f"epsilon: no wheel in {tmp_path}/",
        "omega-1.0-cp311-cp311-manylinux_2_17_x86_64.whl: built for another Python or platform than the GPU image's",
        "stray-1.0-py3-none-any.whl: not named in wheels.txt",
        "alpha-1.0-py3-none-any.whl needs beta>=2; carried beta 1.5",
        "alpha-1.0-py3-none-any.whl needs torch>=3; the image has torch 2.11.0",
        "alpha-1.0-py3-none-any.whl needs zeta, which neither the wheels nor the image has: add zeta to wheels.txt",
    ]
