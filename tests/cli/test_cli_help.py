"""`moh --help` lists every command, Trainer loops and tools, each with one line; a mistyped command is one line naming
the commands and the nearest."""
import inspect
import subprocess
import sys

import pytest

from moh_lightning.cli import TOOLS, _first_sentence, _tool, _tool_doc, main

COMMANDS = ["fit", "validate", "test", "predict", *TOOLS]


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
    assert list(described) == COMMANDS
    assert all(len(line.split()) > 2 and line.endswith(".") for line in described.values())


def test_unknown_command_is_one_line_naming_the_commands_and_the_nearest():
    with pytest.raises(SystemExit) as exit_info:
        main(["gnerate", "--checkpoint", "x.ckpt"])
    message = str(exit_info.value.code)
    assert "\n" not in message and "'gnerate'" in message and "did you mean 'generate'" in message
    assert all(command in message for command in COMMANDS)


def test_help_reads_each_tools_own_docstring_without_importing_the_tools():
    assert {name: _tool_doc(name) for name in TOOLS} == {name: inspect.getdoc(_tool(name)) for name in TOOLS}
    modules = {module.partition(":")[0] for module in TOOLS.values()}
    shown = subprocess.run([sys.executable, "-c", "import sys; from moh_lightning.cli import main; main(['--help']); "
                            f"print(sorted({modules} & set(sys.modules)))"], capture_output=True, text=True, check=True)
    assert shown.stdout.splitlines()[-1] == "[]" and shown.stderr == ""
    assert all(_first_sentence(_tool_doc(name)) in shown.stdout for name in TOOLS)
