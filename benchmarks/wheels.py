"""The wheels the GPU call (``benchmarks/run.sh``) carries in ``.whl/``: made here, installed and checked there.

    python benchmarks/wheels.py                          # here: .whl/ for the GPU image's Python, checked as a set
    python3 benchmarks/wheels.py install [--dry-run]     # run.sh there: one wheel per name, into /tmp/site
    python3 benchmarks/wheels.py check DEVICE TEST...    # run.sh there: the call's imports, floors and tests

``wheels.txt`` beside this file names the distributions; ``image_packages.txt`` what the GPU image already has. Only
the standard library and ``packaging`` (in the image and in the suite's venv), so it runs before anything is
installed: argparse, not the jsonargparse it carries. Every failure ends the process with a line naming what is
missing.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags, sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NAMES = HERE / "wheels.txt"
IMAGE = HERE / "image_packages.txt"
PYTHON = (3, 12)  # the GPU image's python3 (KINDS.md: Python 3.12.3)
# The wheels' platforms: the GPU machine is x86-64 Linux; pip matches a manylinux_2_N tag only for the N named.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "linux_x86_64"]
# What the measuring phases import (their lazy imports included); the CUDA tests are collected in `check` besides.
CALL_MODULES = ["moh_lightning.cli", "moh_lightning.trainer_cli", "benchmarks.steps", "benchmarks.loader",
                "moh_lightning.tools.bench.model_step",
                "moh_lightning.models.vit", "moh_lightning.models.dit", "moh_lightning.models.llama",
                "moh_lightning.data.images", "moh_lightning.tasks"]
# The libraries a reader of the call's log wants first (their versions, and whether carried or the image's).
SHOWN = ["torch", "triton", "liger-kernel", "lightning", "timm", "jsonargparse"]


def norm(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> dict[str, str | None]:
    """``name`` or ``name==version`` lines (``#`` starts a comment) as {name: pinned version or None}."""
    entries = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            entries[norm(name)] = version.strip() or None
    return entries


def suite_requirements() -> list[Requirement]:
    """pyproject's dependencies and its ``gpu`` extra (liger-kernel): what the call may import of the suite's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(line) for line in project["dependencies"] + project["optional-dependencies"]["gpu"]]


def target_tags(python: tuple[int, int] = PYTHON) -> set[Tag]:
    return set(cpython_tags(python, platforms=PLATFORMS)) | set(compatible_tags(python, platforms=PLATFORMS))


def wheel_files(folder: Path) -> tuple[dict[str, list[tuple[Path, str, frozenset]]], list[str]]:
    """{name: [(file, version, tags)]} of ``folder``'s wheels, and the problems of the files that are no wheel."""
    found, problems = {}, []
    for file in sorted(folder.glob("*.whl")):
        try:
            name, version, _, tags = parse_wheel_filename(file.name)
        except InvalidWheelFilename as error:
            problems.append(f"{file.name}: not a wheel's name ({error})")
            continue
        found.setdefault(norm(name), []).append((file, str(version), tags))
    return found, problems


def check_set(folder: Path, wanted: dict[str, str | None], image: dict[str, str | None], tags: set[Tag],
              marker_env: dict | None = None, read_metadata: bool = True) -> list[str]:
    """What is wrong with ``folder`` as the call's wheels: a name of ``wanted`` without a wheel or with two, another
    version than pinned, a wheel for another Python or platform than ``tags``, and (``read_metadata``) a requirement
    that neither another wheel nor the image meets (the image's version checked where ``image`` knows it)."""
    found, problems = wheel_files(folder)
    versions = {}
    for name, pinned in wanted.items():
        files = found.get(name, [])
        if not files:
            problems.append(f"{name}: no wheel in {folder}/")
        elif len(files) > 1:
            problems.append(f"{name}: {len(files)} wheels in {folder}/ ({', '.join(f.name for f, _, _ in files)}); "
                            f"keep one")
        else:
            file, versions[name], file_tags = files[0]
            if pinned and versions[name] != pinned:
                problems.append(f"{file.name}: version {versions[name]}, wheels.txt pins {pinned}")
            if not file_tags & tags:
                problems.append(f"{file.name}: built for another Python or platform than the GPU image's")
    problems += [f"{files[0][0].name}: not named in {NAMES.name}" for name, files in found.items()
                 if name not in wanted]
    if read_metadata:
        for name in versions:
            problems += _unmet(found[name][0][0], versions, image, marker_env)
    return problems


def _unmet(wheel: Path, versions: dict[str, str], image: dict[str, str | None], marker_env: dict | None) -> list[str]:
    """The requirements of ``wheel`` (its extras left out) that neither the carried ``versions`` nor the image meet."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    problems = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
        if requirement.marker and not requirement.marker.evaluate({**(marker_env or {}), "extra": ""}):
            continue
        name = norm(requirement.name)
        if name in versions:
            have, source = versions[name], "carried"
        elif name in image:
            have, source = image[name], "the image has"
        else:
            problems.append(f"{wheel.name} needs {requirement}, which neither the wheels nor the image has: add "
                            f"{name} to {NAMES.name}")
            continue
        if have and not requirement.specifier.contains(have, prereleases=True):
            problems.append(f"{wheel.name} needs {requirement}; {source} {name} {have}")
    return problems


def make(folder: Path) -> None:
    """``folder`` holds exactly the wheels of ``wheels.txt`` for the GPU image's Python, each checked against the
    others and the image, and the suite's own floors are checked against the image's known versions."""
    wanted = read_list(NAMES)
    pins = {}
    for name, pinned in wanted.items():
        try:
            pins[name] = pinned or metadata.version(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"wheels: {name} is neither pinned in {NAMES.name} nor installed in this environment "
                     f"({sys.prefix}); install it or pin it.")
    folder.mkdir(exist_ok=True)
    found, _ = wheel_files(folder)
    for name, files in found.items():  # another version, or a name no longer listed: gone, so one stays of each
        for file, version, _ in files:
            if pins.get(name) != version:
                file.unlink()
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", ".".join(map(str, PYTHON)), "--implementation", "cp", *platforms,
               "--dest", str(folder), *[f"{name}=={version}" for name, version in pins.items()]]
    if subprocess.run(command).returncode:
        sys.exit("wheels: pip download failed (above); nothing was checked.")
    image = read_list(IMAGE)
    target = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    problems = check_set(folder, pins, image, target_tags(), target)
    for requirement in suite_requirements():  # the suite's floors, against what the call will import there
        name = norm(requirement.name)
        have = pins[name] if name in pins else image.get(name)
        if have and not requirement.specifier.contains(have, prereleases=True):
            problems.append(f"the suite needs {requirement}; the call would import {name} {have}")
    found, _ = wheel_files(folder)
    total = 0
    for name in pins:
        for file, _, _ in found.get(name, []):
            total += file.stat().st_size
            print(f"{file.name:60s} {file.stat().st_size / 2**20:6.2f} MiB")
    print(f"{len(pins)} wheels, {total / 2**20:.1f} MiB in {folder}/ (the call carries 64 MiB in all, repository "
          f"included)")
    if problems:
        sys.exit("wheels: the set is not consistent:\n  " + "\n  ".join(problems))
    print("wheels: consistent: one wheel per name, each for Python 3.12 on x86-64 Linux, each requirement carried "
          "or in the image")


def install(folder: Path, site: str, dry_run: bool) -> None:
    """Checks ``folder`` has one wheel for this interpreter per name of ``wheels.txt``, then installs them into
    ``site`` beside the image's packages (``--dry-run``: the names and files only, as CI's fake wheels allow)."""
    wanted = read_list(NAMES)
    if not folder.is_dir():
        sys.exit(f"wheels: no {folder}/ here: make it with `python benchmarks/wheels.py` and carry it "
                 f"(carry: [\"{folder}\"]). Missing: {', '.join(wanted)}")
    problems = check_set(folder, wanted, {}, set(sys_tags()), read_metadata=False)
    if problems:
        sys.exit(f"wheels: {folder}/ cannot be installed (make it again with `python benchmarks/wheels.py`):\n  "
                 + "\n  ".join(problems))
    files = sorted(str(file) for file in folder.glob("*.whl"))
    if not dry_run:  # against the versions this machine has: a mismatch is said, and `check` then tries the imports
        versions = {name: entries[0][1] for name, entries in wheel_files(folder)[0].items()}
        installed = {norm(dist.metadata["Name"]): dist.version for dist in metadata.distributions()}
        for file in files:
            for problem in _unmet(Path(file), versions, installed, None):
                print(f"wheels: warning: {problem}")
    if dry_run:
        print(f"wheels: dry run: the {len(files)} wheels of {NAMES.name} are all in {folder}/; not installed")
        return
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", site, *files]
    if subprocess.run(command).returncode:
        sys.exit(f"wheels: pip install into {site} failed (above).")
    print(f"wheels: installed {len(files)} wheels into {site}: {', '.join(Path(f).name for f in files)}")


def check(device: str, tests: list[str], site: str, dry_run: bool) -> None:
    """Before anything is measured: every module the call imports imports (a missing one raises, naming it), every
    carried distribution imports, on CUDA the GPU is seen and liger-kernel's ops import, and the CUDA tests' ids
    collect. Said, and with ``--dry-run`` failing the check (run on the CPU, it checks ``wheels.txt`` against what the
    call imports): a distribution the call imports through the suite's requirements that is neither carried nor the
    image's, and an imported version outside the suite's range."""
    for module in CALL_MODULES:
        importlib.import_module(module)
    carried = read_list(NAMES)
    modules = _modules_of()
    problems, notes = [], []
    for name in carried:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            (notes if dry_run else problems).append(f"{name}: not installed here (carried to the GPU from .whl/)")
            continue
        own = name.replace("-", "_")  # a distribution may ship other top-level packages (torch-fidelity: tests)
        for module in [own] if own in modules.get(name, []) else modules.get(name, []):
            importlib.import_module(module)
    if device == "cuda":
        import torch

        from moh_lightning.models.llama.fused import fused_kernels_ready

        if not torch.cuda.is_available():
            problems.append("torch sees no CUDA device")
        fused_kernels_ready(True)  # liger-kernel's ops import, or this says how to install them
    loaded = imported_distributions()
    image = read_list(IMAGE)
    needed = needed_distributions(suite_requirements(), loaded, image, carried)
    for name in sorted(needed - set(carried)):
        line = f"{name}: imported by the call, in neither {NAMES.name} nor {IMAGE.name}"
        (problems if dry_run else notes).append(line + ("" if dry_run else " (the image has it: update the list)"))
    for requirement in suite_requirements():  # there, measuring with another version beats measuring nothing
        name = norm(requirement.name)
        if name in loaded and not requirement.specifier.contains(metadata.version(name), prereleases=True):
            (problems if dry_run else notes).append(f"{name} {metadata.version(name)} is imported; the suite needs "
                                                    f"{requirement}: carry it ({NAMES.name})")
    import pytest

    if tests and pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", *tests]) != 0:
        problems.append(f"the CUDA tests' ids do not all collect: {' '.join(tests)}")
    for name in SHOWN:
        print(f"  {name:14s} {_where(name, site)}")
    for note in notes:
        print(f"  note: {note}")
    if problems:
        sys.exit("check: the call cannot run as it is:\n  " + "\n  ".join(problems))
    print(f"check: {len(CALL_MODULES)} modules and {len(carried)} carried distributions import; what the call "
          f"imports beyond the image is carried: {', '.join(sorted(needed))}")


def imported_distributions() -> set[str]:
    """The distributions of every module this process has imported."""
    distributions = metadata.packages_distributions()
    return {norm(dist) for top in {name.partition(".")[0] for name in sys.modules}
            for dist in distributions.get(top, [])}


def _modules_of() -> dict[str, list[str]]:
    """{distribution: its top-level modules} of what is installed."""
    modules = {}
    for module, dists in metadata.packages_distributions().items():
        if not module.startswith("_") and module.isidentifier():
            for dist in dists:
                modules.setdefault(norm(dist), []).append(module)
    return modules


def needed_distributions(roots: list[Requirement], loaded: set[str], image: dict, carried: dict) -> set[str]:
    """The imported distributions the suite reaches through requirements (each imported one's own, extras asked
    included), beyond the image's: what the call must carry. A distribution the image has ends its branch there
    unless it is carried anyway."""
    needed, seen, todo = set(), set(), list(roots)
    while todo:
        requirement = todo.pop()
        name = norm(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen or name not in loaded:
            continue
        seen.add(key)
        if name in image and name not in carried:
            continue
        needed.add(name)
        for line in metadata.requires(name) or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": extra}) for extra in ("", *requirement.extras)):
                todo.append(sub)
    return needed


def _where(name: str, site: str) -> str:
    """``name``'s version, and whether it came from the carried wheels (``site``) or from where."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return "not installed"
    place = Path(str(dist.locate_file(""))).resolve()
    return f"{dist.version} ({'carried' if place == Path(site).resolve() else place})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path(".whl"), help="the wheels' folder")
    parser.add_argument("--site", default="/tmp/site", help="where install puts them (check names what came from it)")
    commands = parser.add_subparsers(dest="command")
    install_parser = commands.add_parser("install")
    install_parser.add_argument("--dry-run", action="store_true")
    check_parser = commands.add_parser("check")
    check_parser.add_argument("device", choices=["cuda", "cpu"])
    check_parser.add_argument("tests", nargs="*")
    check_parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "install":
        install(args.wheels, args.site, args.dry_run)
    elif args.command == "check":
        check(args.device, args.tests, args.site, args.dry_run)
    else:
        make(args.wheels)


if __name__ == "__main__":
    main()
