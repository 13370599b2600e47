"""`moh --help` lists every command, Trainer loops and tools, each with one line; a mistyped command is one line naming
the commands and the nearest."""
import pytest

from moh_lightning.cli import TOOLS, main

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
