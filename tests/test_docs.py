"""The docs say what the suite does: every ``moh`` command written on a page of ``docs/`` or in the README parses, the
embedded default's commands run as written, the README's Python runs, and the pages' map of the package is whole.

A command is parsed in-process with ``--print_config`` (LightningCLI's and jsonargparse's own), which checks the
command's name, every option's name and every value's type without loading data or weights: the part of a docs line
that a GPU, a dataset or a download would otherwise keep from being checked here.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from moh_lightning.cli import COMMANDS, LOOPS, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LAUNCHERS = {"srun", "time", "nohup"}
PLACEHOLDER = re.compile(r"<[^<>\n]+>")
# A run folder a page names, whose config the check gives where the page gives none (a sweep's trial folder names no
# config of its own).
RUN_CONFIGS = {"sweeps/digits_heads/": "vit_tiny_folder_digits_75.yaml"}


def commands(page: Path) -> list[str]:
    """Every ``moh ...`` command in the page's shell blocks, continuation lines joined, each part of a ``&&`` chain
    apart, comments and leading environment settings dropped."""
    found = []
    for language, body in FENCE.findall(page.read_text()):
        if language not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = part.strip().replace("python -m moh_lightning.cli ", "moh ").split()
                while words and (re.fullmatch(r"[A-Z_]+=\S*", words[0]) or words[0] in LAUNCHERS):
                    words.pop(0)
                if "-m" in words and "moh_lightning.cli" in words:  # torchrun ... -m moh_lightning.cli fit ...
                    words = ["moh", *words[words.index("moh_lightning.cli") + 1:]]
                # `moh: ...` and `moh sweep: ...` are what moh prints, not commands
                if words[:1] == ["moh"] and not (len(words) > 1 and words[1].endswith(":")):
                    found.append(" ".join(words))
    return found


DOC_COMMANDS = sorted({(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in commands(page)})


def parse_cases() -> list:
    """A case per command; a training command's parse builds LightningCLI's whole parser (about a second each, some
    eighty of them), so those are slow, and the tools' (milliseconds) run in the quick subset."""
    return [pytest.param(page, command, marks=[pytest.mark.slow] if command.split()[1] in LOOPS else [])
            for page, command in DOC_COMMANDS]


def arguments(command: str) -> list[str]:
    """The command's arguments as the shell would pass them: placeholders (``<ckpt>``) as one word, ``...`` and the
    brackets of an optional part left out."""
    command = PLACEHOLDER.sub(lambda match: re.sub(r"\W+", "_", match.group(0)).strip("_") or "x", command)
    command = re.sub(r"\[(--[^\]]*)\]", r"\1", command)  # `[--top_k 3 --dtype bfloat16]`: options one may add
    return [word for word in shlex.split(command, comments=True)[1:] if word != "..."]


def checkable(args: list[str]) -> list[str]:
    """What ``--print_config`` can check of a training command: a checkpoint file the page names is left out (it
    holds what it holds), and where the page gives no ``--config`` the run folder's config stands in for it."""
    if args[0] not in LOOPS or "--ckpt_path" not in args:
        return args
    at = args.index("--ckpt_path")
    checkpoint = args[at + 1]
    if checkpoint == "last":
        return args
    args = args[:at] + args[at + 2:]
    if "--config" not in args:
        run = re.match(r"runs/([^/]+)/", checkpoint)
        config = f"{run.group(1)}.yaml" if run else next(
            (name for prefix, name in RUN_CONFIGS.items() if checkpoint.startswith(prefix)), None)
        assert config, f"{checkpoint}: no config to check this command with; add its folder to RUN_CONFIGS"
        args[1:1] = ["--config", config]
    return args


def test_the_pages_hold_the_commands():
    pages = {page for page, _ in DOC_COMMANDS}
    unknown = [(page, command) for page, command in DOC_COMMANDS
               if arguments(command)[0] not in COMMANDS and arguments(command)[0] not in ("--help", "-h")]
    assert unknown == [], "commands moh does not have"
    assert len(DOC_COMMANDS) >= 60
    assert {"README.md", "docs/getting-started.md", "docs/tasks/language-models.md"} <= pages
    assert ("README.md", "moh fit --config vit_tiny_mnist_75.yaml") in DOC_COMMANDS  # the quick start's main command


@pytest.mark.parametrize("page, command", parse_cases())
def test_every_command_on_a_page_parses(page, command, run_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = arguments(command)
    if args[:1] in (["--help"], ["-h"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(args)
        assert "fit" in out.getvalue() and "sweep" in out.getvalue()
        return
    assert args and args[0] in COMMANDS, f"{page}: `{command}` names no command of moh"
    args = checkable(args)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main([*args, *([] if "--print_config" in args else ["--print_config"])])
    assert stop.value.code in (0, None), f"{page}: `{command}`: {stop.value.code} {err.getvalue()[-500:]}"
    assert out.getvalue().strip(), f"{page}: `{command}` printed no config"


# The embedded defaults' commands as the pages write them, one after the other in one folder, each at a tiny size:
# the options after a command's own only shorten it (fewer steps, batches, samples; the ViT's fit 2 of its 6 blocks,
# which `moh head-figures` then draws).
TINY = {"fit": ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
                "--trainer.max_steps", "-1", "--trainer.enable_progress_bar=false"],
        "validate": ["--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"],
        "sample": ["--num_samples", "4", "--steps", "2", "--batch_size", "4"]}
FEWER_BLOCKS = {"vit": ["--model.init_args.arch.depth", "2"]}
VIT_CHECKPOINT = "runs/vit_tiny_mnist_75/version_0/checkpoints/last.ckpt"
CHAINS = {
    "vit": [("docs/getting-started.md", "moh fit --config vit_tiny_mnist_75.yaml"),
            ("docs/getting-started.md", f"moh validate --ckpt_path {VIT_CHECKPOINT}"),
            ("docs/getting-started.md", f"moh export-timm --checkpoint {VIT_CHECKPOINT} --out digits_vit"),
            ("docs/guides/dashboards.md", "moh head-figures --run runs/vit_tiny_mnist_75/version_0 --out figs/")],
    "dit": [("README.md", "moh fit --config dit_mnist_90.yaml"),
            ("README.md", "moh sample --checkpoint runs/dit_mnist_90/version_0/checkpoints/last.ckpt --out_dir samples "
                          "--num_samples 100")],
}


@pytest.mark.slow
@pytest.mark.parametrize("chain", CHAINS)
def test_the_embedded_defaults_commands_run_as_written(chain, run_dir, monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
    for page, command in CHAINS[chain]:
        args = arguments(command)
        written = [arguments(line) for on, line in DOC_COMMANDS if on == page]
        assert args in written, f"{page} no longer says `{command}`: update CHAINS with the page"
        main([*args, *TINY.get(args[0], []), *(FEWER_BLOCKS.get(chain, []) if args[0] == "fit" else [])])
    if chain == "vit":
        assert (run_dir / "digits_vit" / "config.json").is_file() and (run_dir / "figs" / "layers.pdf").is_file()
        assert list((run_dir / "runs" / "vit_tiny_mnist_75" / "version_0" / "eval").iterdir())
    else:
        assert (run_dir / "samples" / "samples.npz").is_file()


def test_the_readme_is_the_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if line.startswith("python -m pytest"))
    assert test_command in readme  # the quick start's test command is what CI runs
    for link in re.findall(r"\]\(((?:docs|results)/[^)#]*|[A-Z]+\.(?:md|cff)|LICENSE)\)", readme):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_the_readmes_python_runs():
    block = next(body for language, body in FENCE.findall((ROOT / "README.md").read_text())
                 if language == "python" and "MoHAttention" in body)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert tuple(scope["y"].shape) == (8, 197, 384) and tuple(scope["attn"].last_gates.shape) == (8, 197, 6)
    assert int((scope["attn"].last_gates[0, 0] > 0).sum()) == 4  # 2 shared + top-2 of 4 routed, as its comment says


def test_the_layout_names_every_module_and_no_other():
    page = (ROOT / "docs" / "developer.md").read_text()
    layout = page[page.index("```\nmoh_lightning/"):]
    layout = layout[:layout.index("\n```", 4)]
    package = ROOT / "moh_lightning"
    modules = {path.name for path in package.rglob("*.py") if path.name != "__init__.py"}
    folders = {f"{path.name}/" for path in package.rglob("*") if path.is_dir() and path.name != "__pycache__"}
    named = set(re.findall(r"\b(\w+\.py)\b", layout))
    assert modules - named == set(), "modules the layout in docs/developer.md does not name"
    for folder in folders:
        assert folder in layout, f"the layout in docs/developer.md does not name moh_lightning's {folder}"
    elsewhere = {path.name for folder in ("benchmarks", "tests") for path in (ROOT / folder).rglob("*.py")}
    assert named - modules - elsewhere == set(), "files the layout names that are gone"


def test_the_citation_and_license_match_the_package():
    import yaml

    pyproject = (ROOT / "pyproject.toml").read_text()
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    version, license_ = citation["version"], citation["license"]
    assert f'version = "{version}"' in pyproject and f'license = {{ text = "{license_}" }}' in pyproject
    assert "2410.11842" in str(citation["preferred-citation"])
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert 'python -m pytest -m "not slow" tests' in contributing and "under 2 minutes" in contributing
