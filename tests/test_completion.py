"""``wattwatch completion bash|zsh|fish``: the scripts parse in their shells, and bash's completes what the
parser has (commands, actions, options, option choices) when driven as bash drives it on Tab."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
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
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "wattwatch.bash"
    path.write_text(script("bash"))
    return path


def complete(bash_script: Path, *words: str) -> list[str]:
    """What Tab offers after ``words`` (the last one is the word being completed)."""
    line = " ".join(shlex.quote(w) for w in words)
    probe = (
        f"source {shlex.quote(str(bash_script))}\n"
        f"COMP_WORDS=({line}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); _wattwatch\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    out = subprocess.run(["bash", "--norc", "-c", probe], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0 and not out.stderr, out.stderr
    return [w for w in out.stdout.splitlines() if w]


def test_bash_script_is_valid_and_lists_every_command(bash_script: Path) -> None:
    check = subprocess.run(["bash", "-n", str(bash_script)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    top = re.search(r"^        '' *\) cmds='([^']*)'", bash_script.read_text(), re.M)
    assert top and set(top[1].split()) >= COMMANDS
    assert set(complete(bash_script, "wattwatch", "")) >= COMMANDS


def test_bash_completes_commands_actions_options_and_choices(bash_script: Path) -> None:
    assert complete(bash_script, "wattwatch", "rep") == ["report"]
    assert complete(bash_script, "wattwatch", "report", "--fo") == ["--format"]
    assert complete(bash_script, "wattwatch", "report", "--format", "") == ["table", "json", "csv", "markdown"]
    # An option's value before the command is skipped, not taken for a command.
    assert complete(bash_script, "wattwatch", "--home", "/tmp/x", "report", "--kind", "t") == ["training"]
    assert complete(bash_script, "wattwatch", "token", "cr") == ["create"]
    assert complete(bash_script, "wattwatch", "token", "create", "--role", "") == ["agent", "reader", "admin"]
    assert complete(bash_script, "wattwatch", "completion", "") == ["bash", "zsh", "fish"]
    assert "--once" in complete(bash_script, "wattwatch", "top", "--")
    # A value with no choices completes as a file name (--home, --token-file), never as an option.
    assert not any(w.startswith("-") for w in complete(bash_script, "wattwatch", "top", "--token-file", ""))


def test_zsh_script_parses() -> None:
    zsh = shutil.which("zsh")
    if zsh is None:
        unavailable("zsh not found (Debian: apt-get install zsh)")
    path = Path(zsh)
    check = subprocess.run([str(path), "-n"], input=script("zsh"), capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr


def test_fish_script_completes_every_command_and_parses() -> None:
    text = script("fish")
    commands = {m[1] for m in re.finditer(r"-n __fish_use_subcommand -a (\S+)", text)}
    assert commands >= COMMANDS
    assert "-l format -x -a 'table json csv markdown'" in text
    for line in text.splitlines()[1:]:
        assert shlex.split(line)[:3] == ["complete", "-c", "wattwatch"], line
    fish = shutil.which("fish")
    if fish is None:
        unavailable("fish not found (Debian: apt-get install fish)")
    check = subprocess.run([fish, "--no-execute"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
