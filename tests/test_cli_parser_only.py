"""A run declares only its own command's options (``build_parser(only=...)``): the same help, the same
parsed arguments and the same errors as the full parser, for every command and action."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from wattwatch.cli import build_parser


def _commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


FULL = build_parser()
COMMANDS = sorted(_commands(FULL))


def test_every_command_is_listed_whichever_is_built() -> None:
    assert len(COMMANDS) >= 12
    for command in COMMANDS:
        assert build_parser(only=command).format_help() == FULL.format_help()
    assert build_parser(only="no-such-command").format_help() == FULL.format_help()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_built_alone_is_the_same_parser(command: str) -> None:
    """Its help, and that of each of its actions (``token create``, ``db upgrade`` ...), byte for byte."""
    alone = _commands(build_parser(only=command))[command]
    full = _commands(FULL)[command]
    assert alone.format_help() == full.format_help()
    actions_alone, actions_full = _commands(alone), _commands(full)
    assert sorted(actions_alone) == sorted(actions_full)
    for name, parser in actions_full.items():
        assert actions_alone[name].format_help() == parser.format_help()


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "--since", "7d", "--kind", "training", "--format", "json", "--label", "team=nlp", "--home", "/h"],
        ["--home", "/h", "-v", "jobs", "--limit", "5"],
        ["agent", "--simulate", "8", "--interval", "0.5", "--collector", "http://c:8470"],
        ["token", "create", "--role", "reader"],
        ["db", "upgrade", "--db", "sqlite:///x.db"],
        ["run", "--kind", "inference", "--name", "chat", "--", "sleep", "1"],
        # argparse takes unique prefixes of options: `--hom X` is `--home X`, so X is not the command.
        ["--hom", "/h", "report", "--db", "sqlite://"],
        ["--log", "error", "jobs", "--format", "json"],
        ["--home=/h", "top", "--once"],
    ],
    ids=lambda a: " ".join(a[:3]),
)
def test_the_same_arguments_parse_the_same(argv: list[str]) -> None:
    from wattwatch.quick_exit import command_of

    assert vars(build_parser(only=command_of(argv)).parse_args(argv)) == vars(FULL.parse_args(argv))


def test_an_unknown_option_is_refused_alike(capsys: pytest.CaptureFixture[str]) -> None:
    errors = []
    for parser in (FULL, build_parser(only="report")):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["report", "--no-such-option"])
        assert exit_info.value.code == 2
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[1] and "--no-such-option" in errors[0]


def test_a_misread_command_word_falls_back_to_the_full_parser(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Whatever the command word looked like, main parses as the full parser does: `--hom X report`."""
    from wattwatch.cli import main

    url = f"sqlite:///{tmp_path / 'w.db'}"
    assert main(["--hom", str(tmp_path / "home"), "db", "upgrade", "--db", url]) == 0
    capsys.readouterr()
    assert main(["--hom", str(tmp_path / "home"), "report", "--db", url, "--format", "json"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("{")
