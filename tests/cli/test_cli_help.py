"""`moh --help` lists every command, Trainer loops and tools, each with one line (without importing any of them:
tests/test_lean_imports.py); a mistyped command is one line naming the commands and the nearest. A command leaves no
empty inductor folder in $TMPDIR: tests/cli/test_bad_input_walk.py, on its run of the command in a process."""
import inspect
import re

import pytest
from lightning.pytorch.cli import LightningCLI

from moh_lightning.cli import COMMANDS, LOOPS, TOOLS, command_description, main, target


@pytest.mark.parametrize("args", [["--help"], ["-h"], []])
def test_help_and_no_command_list_every_command_with_a_line_each(args, capsys):
    if args:
        main(args)
        out = capsys.readouterr().out
    else:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code not in (0, None)
        out = str(exit_info.value.code)
    described = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert list(described) == list(COMMANDS)
    assert all(len(line.split()) > 2 and line.endswith(".") for line in described.values())


def test_unknown_command_is_one_line_naming_the_commands_and_the_nearest():
    with pytest.raises(SystemExit) as exit_info:
        main(["gnerate", "--checkpoint", "x.ckpt"])
    message = str(exit_info.value.code)
    assert "\n" not in message and "'gnerate'" in message and "did you mean 'generate'" in message
    assert all(command in message for command in COMMANDS)


def _first_sentence(doc: str) -> str:
    sentence = " ".join(doc.strip().split("\n\n")[0].split()).split(". ")[0].rstrip(".")
    return sentence.replace("``", "`") + "."


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_line_is_the_first_sentence_of_what_runs_the_command(name):
    assert COMMANDS[name].summary == _first_sentence(inspect.getdoc(target(COMMANDS[name])))


def test_the_loops_are_lightning_clis_subcommands():
    assert list(LOOPS) == list(LightningCLI.subcommands())


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_loop_builds_the_parser_of_its_own_command_only(command, monkeypatch, capsys):
    # The other loops' parsers were most of a command's start; their options still parse (tests/test_docs.py).
    built = []
    prepare = LightningCLI._prepare_subcommand_parser
    monkeypatch.setattr(LightningCLI, "_prepare_subcommand_parser",
                        lambda cli, trainer, name, **kw: built.append(name) or prepare(cli, trainer, name, **kw))
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", "vit_tiny_mnist_75.yaml", "--print_config"])
    assert exit_info.value.code in (0, None) and "model:" in capsys.readouterr().out
    assert built == [command]


def _tool_help(name: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # a paragraph or an option's help a line each: nothing wrapped at a hyphen
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("name", list(TOOLS))
def test_each_tools_help_is_whole_and_names_only_current_commands(name, capsys, monkeypatch):
    """`moh convert-hf --help` once stopped at "attention interface (Qwen2," (jsonargparse shows a docstring's first
    line), and `moh lm-eval --help` named convert-llama's folders but not convert-hf's."""
    shown = _tool_help(name, capsys, monkeypatch)
    description = shown.split("\n\n", 1)[1].split("\noptions:")[0].strip()
    paragraphs = [" ".join(paragraph.split()) for paragraph in description.split("\n\n")]
    written = [" ".join(paragraph.split()) for paragraph in command_description(target(TOOLS[name])).split("\n\n")]
    assert paragraphs == written  # every paragraph of the docstring before its Args:, in full
    assert all(paragraph.endswith(".") for paragraph in paragraphs)
    options = [line.split("  ", 1)[1].strip() for line in shown.split("\noptions:")[1].splitlines()
               if line.startswith("  --") and "  " in line.strip()]
    said = [option.rsplit(" (", 1)[0] if "type:" in option else option for option in options]
    assert said and all(text.endswith((".", ".)")) for text in said), said
    named = set(re.findall(r"`moh ([a-z][\w-]*)", shown))
    assert named <= set(COMMANDS), f"names no command: {named - set(COMMANDS)}"


def test_lm_eval_help_names_the_folders_of_convert_hf(capsys, monkeypatch):
    assert "moh convert-hf" in _tool_help("lm-eval", capsys, monkeypatch)
