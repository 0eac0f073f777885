"""``wattwatch`` as a process: its whole output arrives through a pipe, its exit codes and one-line errors
are what the command decided, options parse as argparse takes them, and starting a command imports no
SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from procs import WATTWATCH
from wattwatch.cli.completion import script
from wattwatch.cli.main import build_parser, main


def test_a_command_writes_all_its_output_through_a_pipe(tmp_path: Path) -> None:
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path)}
    out = subprocess.run([*WATTWATCH, "completion", "bash"], env=env, capture_output=True, timeout=60, check=False)
    assert out.returncode == 0
    assert out.stdout.decode() == script("bash")
    db = f"sqlite:///{tmp_path / 'w.db'}"
    subprocess.run([*WATTWATCH, "db", "upgrade", "--db", db], env=env, capture_output=True, timeout=60, check=True)
    report = subprocess.run(
        [*WATTWATCH, "report", "--db", db, "--format", "json"], env=env, capture_output=True, timeout=60, check=False
    )
    assert report.returncode == 0 and json.loads(report.stdout)["jobs"] == []


def test_a_command_keeps_its_exit_code_and_its_one_line_error(tmp_path: Path) -> None:
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path)}
    out = subprocess.run(
        [*WATTWATCH, "report", "--since", "yesterday"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 2
    assert out.stderr.startswith("wattwatch report: error: --since") and len(out.stderr.splitlines()) == 1
    away = subprocess.run(
        [*WATTWATCH, "top", "--once", "--server", "http://127.0.0.1:9"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert away.returncode == 1 and len(away.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "home"),
    [
        (["report", "--since", "7d", "--home", "/h"], "/h"),
        (["--home", "/h", "-v", "jobs", "--limit", "5"], "/h"),
        # argparse takes unique prefixes of options: `--hom X` is `--home X`, so X is not the command.
        (["--hom", "/h", "report", "--db", "sqlite://"], "/h"),
        (["--home=/h", "top", "--once"], "/h"),
        (["--home", "/a", "report", "--home", "/b"], "/b"),  # after the command wins
    ],
    ids=lambda a: " ".join(a[:3]) if isinstance(a, list) else a,
)
def test_global_options_parse_before_and_after_the_command(argv: list[str], home: str) -> None:
    assert build_parser().parse_args(argv).home == home


def test_an_unknown_option_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["report", "--no-such-option"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--no-such-option" in err


def test_a_prefix_of_a_global_option_reaches_the_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    assert main(["--hom", str(tmp_path / "home"), "db", "upgrade", "--db", url]) == 0
    capsys.readouterr()
    assert main(["--hom", str(tmp_path / "home"), "report", "--db", url, "--format", "json"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("{")


def test_every_command_and_action_has_help_with_examples() -> None:
    words = [["up"], ["demo"], ["collector"], ["agent"], ["run"], ["report"], ["doctor"], ["db"], ["db", "upgrade"]]
    words += [["token"], ["token", "create"], ["jobs"], ["spool"], ["spool", "requeue"], ["top"], ["completion"]]
    for argv in words:
        out = subprocess.run([*WATTWATCH, *argv, "--help"], capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0 and "example" in out.stdout, argv


def test_the_sdk_loads_on_first_use_and_stays_reachable() -> None:
    code = (
        "import sys, wattwatch, wattwatch.cli.main\n"
        "wattwatch.cli.main.build_parser()\n"
        "assert 'wattwatch.sdk' not in sys.modules, 'a command start imports no SDK'\n"
        "assert 'argcomplete' not in sys.modules, 'completion support loads only when the shell asks'\n"
        "from wattwatch import job, step\n"
        "assert wattwatch.sdk.job is job and wattwatch.step is step and wattwatch.query and wattwatch.epoch\n"
        "try:\n    wattwatch.nope\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no error')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
