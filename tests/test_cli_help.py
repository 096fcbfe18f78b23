"""``hedgecats --help``: a usage line, then every subcommand with a one-line description and its
own usage; each listed subcommand is one the command dispatches."""

from __future__ import annotations

import re

import pytest

from hedgecats.cli import main

SUBCOMMANDS = ("pipeline", "fit", "validate", "test", "evaluate", "export", "generate",
               "import-lolcats", "select-layers")


def test_help_has_a_usage_line_and_describes_each_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hedgecats ")
    for name in SUBCOMMANDS:
        line = re.search(rf"^  {re.escape(name)}\s{{2,}}(\S.*)$", out, re.M)
        assert line and len(line[1]) > 20, f"no description of {name!r} in:\n{out}"
        assert re.search(rf"^\s+hedgecats {re.escape(name)}( |$)", out, re.M), \
            f"no usage of {name!r} in:\n{out}"
    assert "hedgecats COMMAND --help" in out


@pytest.mark.parametrize("name", [n for n in SUBCOMMANDS if n not in ("fit", "validate", "test")])
def test_each_listed_subcommand_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert f"hedgecats {name}" in capsys.readouterr().out


def test_unknown_command_lists_the_commands(capsys):
    assert main(["evalute"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'evalute'" in err and "evaluate" in err
    assert "hedgecats --help" in err
