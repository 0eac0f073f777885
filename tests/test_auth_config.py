"""Where tokens come from: argv, the environment, or a file (kept out of process lists)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wattwatch.cli.main import build_parser
from wattwatch.cli.settings import settings_from as _settings_from
from wattwatch.config import load_settings, resolve_token
from wattwatch.errors import ConfigError


def test_a_token_file_is_read_and_stripped(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("ww_abc\n")
    settings = load_settings({"WATTWATCH_HOME": str(tmp_path), "WATTWATCH_TOKEN_FILE": str(tmp_path / "t")})
    assert resolve_token(settings).token == "ww_abc"
    assert resolve_token(load_settings({"WATTWATCH_HOME": str(tmp_path), "WATTWATCH_TOKEN": "x"})).token == "x"


@pytest.mark.parametrize(
    ("content", "extra_env", "needle"),
    [
        (None, {}, "cannot read the token file"),
        ("", {}, "one token on one line"),
        ("two\ntokens\n", {}, "one token on one line"),
        ("ww_abc", {"WATTWATCH_TOKEN": "also"}, "use one"),
    ],
)
def test_bad_token_sources_say_what_to_fix(
    tmp_path: Path, content: str | None, extra_env: dict[str, str], needle: str
) -> None:
    if content is not None:
        (tmp_path / "t").write_text(content)
    env = {"WATTWATCH_HOME": str(tmp_path), "WATTWATCH_TOKEN_FILE": str(tmp_path / "t"), **extra_env}
    with pytest.raises(ConfigError, match=needle):
        resolve_token(load_settings(env))


def test_the_command_line_beats_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t").write_text("from-file\n")
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path))
    monkeypatch.setenv("WATTWATCH_TOKEN", "from-env")
    parser = build_parser()
    for command in (["agent"], ["collector"], ["report", "--server", "https://c:8470"]):
        args = parser.parse_args([*command, "--token-file", str(tmp_path / "t")])
        assert _settings_from(args).token == "from-file"
        assert _settings_from(parser.parse_args([*command, "--token", "from-argv"])).token == "from-argv"
        assert _settings_from(parser.parse_args(command)).token == "from-env"
    with pytest.raises(SystemExit):
        parser.parse_args(["agent", "--token", "a", "--token-file", "b"])
    args = parser.parse_args(["agent", "--ca-file", "ca.pem"])
    assert _settings_from(args).ca_file == "ca.pem"


@pytest.mark.parametrize("action", ["create", "list", "revoke"])
def test_token_actions_have_help_with_examples(action: str, capsys: pytest.CaptureFixture[str]) -> None:
    from wattwatch.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["token", action, "--help"])
    assert exit_info.value.code == 0
    assert "example" in capsys.readouterr().out
