"""Mistakes generated from what each command takes, not listed by hand: every argument of every tool given values its
type rules out, every number of the embedded defaults' configs given a wrong type or a value its name rules out,
damaged and misplaced checkpoints, and malformed configs. Each ends in one line naming the key or the file, a non-zero
exit, no traceback, and nothing written in the working folder."""
from __future__ import annotations

import inspect
import os

import pytest
import torch

from moh_lightning.cli import TOOLS, main, target
from moh_lightning.cli_args import resolve_config_args
from moh_lightning.trainer_cli import MoHLightningCLI
from moh_lightning.value_checks import FRACTIONS, NON_NEGATIVE, OPEN_FRACTIONS, POSITIVE, TOP_P

EMBEDDED = ["vit_tiny_mnist_75.yaml", "dit_mnist_90.yaml", "llm_stdlib_75.yaml"]


def _bad_values(annotation: str) -> list[str]:
    """Values an argument's type rules out, from its annotation's text."""
    if annotation.startswith(("list", "Sequence", "dict", "tuple")):
        return ["[unclosed"]
    for kind, values in (("bool", ["maybe"]), ("PositiveInt", ["0", "-3", "1.5"]), ("NonNegativeInt", ["-1", "x"]),
                         ("PositiveFloat", ["0", "-0.5", "x"]), ("NonNegativeFloat", ["-1", "x"]),
                         ("OpenUnitInterval", ["0", "1.5"]), ("int", ["x", "1.5"]), ("float", ["x"]),
                         ("Literal", ["not-a-choice"])):
        if kind in annotation:
            return values
    return []


def _tool_cases() -> list:
    return [pytest.param(command, name, value, id=f"{command}-{name}-{value}") for command in TOOLS
            for name, parameter in inspect.signature(target(TOOLS[command])).parameters.items()
            for value in _bad_values(str(parameter.annotation))]


def _refused(args: list[str], folder, capsys) -> str:
    """The line ``moh <args>`` stops with, after checking the exit, that no traceback was printed and that ``folder``
    (the working folder) is as it was."""
    before = sorted(folder.rglob("*"))
    with pytest.raises(SystemExit) as stop:
        main(args)
    message = str(stop.value.code)
    assert stop.value.code not in (0, None) and "\n" not in message and message.startswith("moh"), message
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(folder.rglob("*")) == before
    return message


@pytest.mark.parametrize(("command", "name", "value"), _tool_cases())
def test_a_tool_argument_its_type_rules_out_is_one_line_naming_it(command, name, value, run_dir, capsys):
    message = _refused([command, f"--{name}", value], run_dir, capsys)
    assert f"'{name}'" in message or f"--{name}" in message, message


def _required(command: str) -> list[str]:
    parameters = inspect.signature(target(TOOLS[command])).parameters.values()
    return [parameter.name for parameter in parameters if parameter.default is inspect.Parameter.empty]


@pytest.mark.parametrize("command", [command for command in TOOLS if _required(command)])
def test_a_tool_without_its_required_options_names_each_flag(command, run_dir, capsys):
    message = _refused([command], run_dir, capsys)
    assert all(f"--{name}" in message for name in _required(command)) and f"moh {command} --help" in message, message


def _checkpoint_arguments() -> list:
    return [pytest.param(command, name, id=f"{command}-{name}") for command in TOOLS
            for name in inspect.signature(target(TOOLS[command])).parameters if name in ("checkpoint", "ckpt_path")]


def _damaged(kind: str, folder) -> str:
    path = folder.parent / f"{kind}.ckpt"  # beside the working folder, whose files are counted
    if kind == "missing":
        return str(path)
    if kind == "folder":
        path.mkdir(exist_ok=True)
        return str(path)
    torch.save({"state_dict": {"w": torch.zeros(64)}}, path)
    data = path.read_bytes()
    path.write_bytes({"empty": b"", "random": os.urandom(4096), "truncated": data[:len(data) // 2],
                      "foreign": data}[kind])
    return str(path)


@pytest.mark.parametrize("kind", ["missing", "folder", "empty", "random", "truncated", "foreign"])
@pytest.mark.parametrize(("command", "name"), _checkpoint_arguments())
def test_a_damaged_or_misplaced_checkpoint_is_one_line_naming_it(command, name, kind, run_dir, capsys):
    path = _damaged(kind, run_dir)
    extra = ["--out", "out"] if "out" in inspect.signature(target(TOOLS[command])).parameters else []
    message = _refused([command, f"--{name}", path, *extra], run_dir, capsys)
    assert os.path.basename(path) in message, message


@pytest.mark.parametrize("kind", ["missing", "folder", "empty", "random", "truncated", "foreign"])
def test_a_damaged_or_misplaced_ckpt_path_is_one_line_naming_it(kind, run_dir, capsys):
    path = _damaged(kind, run_dir)
    message = _refused(["validate", "--config", "vit_tiny_mnist_75.yaml", "--ckpt_path", path], run_dir, capsys)
    assert os.path.basename(path) in message, message


@pytest.mark.parametrize(("content", "says"), [(b"model: [\n", "not valid YAML"), (os.urandom(512), "not a text file"),
                                               (b"extends: 5\n", "extends=5"), (b"- a\n- b\n", "not keys"),
                                               (b"extends: no_such_base.yaml\n", "no_such_base.yaml"),
                                               (b"data:\n  init_args:\n    batch_size:16\n", "'batch_size: 16'")])
def test_a_malformed_config_is_one_line_naming_it(content, says, run_dir, capsys, tmp_path_factory):
    config = tmp_path_factory.mktemp("own") / "mine.yaml"
    config.write_bytes(content)
    message = _refused(["fit", "--config", str(config)], run_dir, capsys)
    assert says in message and ("mine.yaml" in message or "no_such_base" in message), message


def _numbers(name: str) -> dict[str, object]:
    """The numeric keys of a shipped config as ``moh fit --print_config`` prints them, flat."""
    from conftest import printed_config

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                yield f"{prefix}{key}", value

    return dict(flat(printed_config(["--config", name])))


def _ruled_out(key: str) -> str | None:
    """A value the key's name rules out (``moh_lightning.value_checks``), None where its name says nothing."""
    last, parent = key.rsplit(".", 2)[-1], key.rsplit(".", 2)[-2]
    if parent == "arch" and ("drop" in last or "prob" in last):
        return "1.5"
    if last in POSITIVE or parent == "arch":
        return "0"
    if last in NON_NEGATIVE:
        return "-1"
    if last in FRACTIONS | OPEN_FRACTIONS | TOP_P:
        return "1.5"
    return None


def _checked_by(key: str) -> str:
    """Where a key's number is checked: its network config (``arch``), the task or the data module."""
    return next(place for place in ("model.init_args.arch", "model.init_args", "data.init_args")
                if key.startswith(f"{place}."))


@pytest.mark.slow
@pytest.mark.parametrize("config", EMBEDDED)
def test_every_number_of_an_embedded_default_refuses_a_wrong_type_and_what_its_name_rules_out(config, run_dir,
                                                                                              capsys):
    """The wrong type is refused by the parser (one parser for the config's keys), a value the key's name rules out
    when the task and data module are built: a fresh command for one key of each rule at each place that checks (the
    task, its network config, the data module; a command is seconds, and the rules by name are unit-tested in
    test_value_checks.py)."""
    keys = {key: value for key, value in _numbers(config).items() if key.startswith(("model.", "data."))}
    assert len(keys) > 5
    parser = MoHLightningCLI(args=["--config", config, "--trainer.logger", "false"], run=False).parser
    expanded = resolve_config_args(["--config", config])
    for key in keys:
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([*expanded, f"--{key}", "not-a-number"])
        assert "\n" not in str(stop.value.code) and key.rsplit(".", 1)[-1] in str(stop.value.code)
    ruled_out = {}
    for key in keys:
        if (value := _ruled_out(key)) is not None:
            ruled_out.setdefault((_checked_by(key), value), (key, value))
    assert {place for place, _ in ruled_out} == {"model.init_args.arch", "model.init_args", "data.init_args"}
    for key, value in ruled_out.values():
        message = _refused(["fit", "--config", config, f"--{key}", value, "--trainer.max_steps", "0"], run_dir, capsys)
        assert key.rsplit(".", 1)[-1] in message, message


@pytest.mark.parametrize(("classes", "says"), [([], "no class folders"), (["only"], "two classes or more")])
def test_data_found_wanting_when_the_run_starts_leaves_no_run_folder(classes, says, run_dir, capsys):
    for name in classes:
        (run_dir / "data" / name).mkdir(parents=True)
    message = _refused(["fit", "--config", "vit_tiny_folder_digits_75.yaml", "--data.init_args.data_dir", "data",
                        "--trainer.max_steps", "1"], run_dir, capsys)
    assert says in message and "data" in message, message
