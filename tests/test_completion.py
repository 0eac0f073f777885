"""``wattwatch completion bash|zsh|fish``: each script loads in its shell, and Tab there offers what the
parser has (commands, actions, options, option choices), asked of the real ``wattwatch`` command as the
shell asks it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import unavailable
from procs import WATTWATCH

COMMANDS = {
    "up",
    "demo",
    "collector",
    "agent",
    "run",
    "report",
    "jobs",
    "doctor",
    "db",
    "token",
    "spool",
    "top",
    "completion",
}


def script(shell: str) -> str:
    out = subprocess.run([*WATTWATCH, "completion", shell], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment whose PATH has a ``wattwatch`` command running this checkout's code: the scripts call
    the command by its name."""
    bin_dir = tmp_path_factory.mktemp("bin")
    command = bin_dir / "wattwatch"
    command.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m wattwatch.cli.main "$@"\n')
    command.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "wattwatch.bash"
    path.write_text(script("bash"))
    return path


def complete(bash_script: Path, env: dict[str, str], line: str) -> list[str]:
    """What Tab offers at the end of ``line`` in bash: its completion function, given the words and
    cursor as bash gives them."""
    probe = (
        f"source {shlex.quote(str(bash_script))}\n"
        'COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}; COMP_TYPE=9\n'
        'read -ra COMP_WORDS <<< "$COMP_LINE"; [[ "$COMP_LINE" == *" " ]] && COMP_WORDS+=("")\n'
        "COMP_CWORD=$((${#COMP_WORDS[@]} - 1))\n"
        "_python_argcomplete wattwatch\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    out = subprocess.run(
        ["bash", "--norc", "-c", probe, "probe", line], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and not out.stderr, out.stderr
    return [w.strip() for w in out.stdout.splitlines() if w.strip()]


def test_bash_script_is_valid_and_offers_every_command(bash_script: Path, shell_env: dict[str, str]) -> None:
    check = subprocess.run(["bash", "-n", str(bash_script)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    assert set(complete(bash_script, shell_env, "wattwatch ")) >= COMMANDS


def test_bash_completes_commands_actions_options_and_choices(bash_script: Path, shell_env: dict[str, str]) -> None:
    assert complete(bash_script, shell_env, "wattwatch rep") == ["report"]
    assert complete(bash_script, shell_env, "wattwatch report --fo") == ["--format"]
    assert complete(bash_script, shell_env, "wattwatch report --format ") == ["table", "json", "csv", "markdown"]
    # An option's value before the command is skipped, not taken for a command.
    assert complete(bash_script, shell_env, "wattwatch --home /tmp/x report --kind t") == ["training"]
    assert complete(bash_script, shell_env, "wattwatch token cr") == ["create"]
    assert complete(bash_script, shell_env, "wattwatch token create --role ") == ["agent", "reader", "admin"]
    assert complete(bash_script, shell_env, "wattwatch completion ") == ["bash", "zsh", "fish"]
    assert "--once" in complete(bash_script, shell_env, "wattwatch top --")


def test_zsh_script_parses_and_registers_the_completer(shell_env: dict[str, str]) -> None:
    zsh = shutil.which("zsh")
    if zsh is None:
        unavailable("zsh not found (Debian: apt-get install zsh)")
    text = script("zsh")
    check = subprocess.run([zsh, "-n"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    # Loaded as ~/.zshrc loads it, the script tells zsh's completion system which function completes us.
    load = f"autoload -U compinit && compinit -u -D\n{text}\nprint -r -- $_comps[wattwatch]\n"
    out = subprocess.run([zsh, "-f", "-c", load], env=shell_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "_python_argcomplete", out.stdout + out.stderr
    # What that function asks the command (its zsh request, `name:description` answers).
    ask = {**shell_env, "_ARGCOMPLETE": "1", "_ARGCOMPLETE_SHELL": "zsh", "_ARGCOMPLETE_SUPPRESS_SPACE": "1"}
    ask["COMP_LINE"] = "wattwatch rep"
    ask["COMP_POINT"] = str(len(ask["COMP_LINE"]))
    answer = subprocess.run(
        [zsh, "-f", "-c", "wattwatch 8>&1 9>&2 1>/dev/null 2>&1 </dev/null"],
        env=ask, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert answer.returncode == 0 and answer.stdout.split(":")[0] == "report", answer.stdout


def test_fish_completes_commands_options_and_choices(shell_env: dict[str, str], tmp_path: Path) -> None:
    fish = shutil.which("fish")
    if fish is None:
        unavailable("fish not found (Debian: apt-get install fish)")
    path = tmp_path / "wattwatch.fish"
    path.write_text(script("fish"))
    check = subprocess.run([fish, "--no-execute", str(path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr

    def offered(line: str) -> list[str]:
        probe = f"source {shlex.quote(str(path))}; complete -C {shlex.quote(line)}"
        out = subprocess.run(
            [fish, "--no-config", "-c", probe], env=shell_env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return [w.split("\t")[0] for w in out.stdout.splitlines()]

    assert set(offered("wattwatch ")) >= COMMANDS
    assert offered("wattwatch rep") == ["report"]
    assert sorted(offered("wattwatch report --format ")) == ["csv", "json", "markdown", "table"]
    assert offered("wattwatch token create --role a") == ["admin", "agent"]
