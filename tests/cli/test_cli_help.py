"""Every option and argument of every `pd-cluster` command says what it is for in `--help`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from pd_cluster.cli import build_parser


def walk(parser: argparse.ArgumentParser, path: str = "pd-cluster") -> Iterator[tuple[str, argparse.Action]]:
    """(command path, action) for every argument of ``parser`` and of its subcommands, recursively."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_of_every_command_has_a_help_text():
    actions = list(walk(build_parser()))
    commands = {path for path, _ in actions}
    assert {"pd-cluster local", "pd-cluster master", "pd-cluster nodes drain", "pd-cluster bench serve",
            "pd-cluster status"} <= commands  # the walk reaches nested commands
    missing = sorted(f"{path}: {'/'.join(a.option_strings) or a.dest}" for path, a in actions
                     if not (a.help and a.help.strip()) and a.help != argparse.SUPPRESS)
    assert not missing, "options without a help text:\n" + "\n".join(missing)


def test_every_subcommand_has_a_help_line():
    def subcommands(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, str | None]]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help for choice in action._choices_actions}
                for name, sub in action.choices.items():
                    yield f"{path} {name}", helps.get(name)
                    yield from subcommands(sub, f"{path} {name}")

    missing = [path for path, text in subcommands(build_parser(), "pd-cluster") if not text]
    assert not missing, "subcommands without a help line: " + ", ".join(missing)
