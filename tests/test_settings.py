"""One settings model: flags, ``WATTWATCH_*`` variables and the TOML file pass the same checks, and a bad
value is one line on stderr naming the setting as the user gave it and what is allowed, exit 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from procs import WATTWATCH
from wattwatch.config import ENV_VARS, RANGES, SWITCHES, TEXT_FORMS, Settings, load_settings
from wattwatch.errors import ConfigError

BAD_INTERVALS = ("0", "nan", "-1")


def _run(argv: list[str], home: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WATTWATCH_")}
    full_env.update({"WATTWATCH_HOME": str(home), **(env or {})})
    return subprocess.run([*WATTWATCH, *argv], env=full_env, capture_output=True, text=True, timeout=60, check=False)


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == "", out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["agent", "up"])
@pytest.mark.parametrize("value", BAD_INTERVALS)
@pytest.mark.parametrize("source", ["flag", "env", "toml"])
def test_a_bad_interval_is_one_line_naming_it_and_the_range(
    tmp_path: Path, command: str, value: str, source: str
) -> None:
    argv, env = [command, "--simulate", "1"], {}
    if source == "flag":
        argv += ["--interval", value]
        named = f"--interval {value}"
    elif source == "env":
        env["WATTWATCH_INTERVAL"] = value
        named = f"WATTWATCH_INTERVAL={value}"
    else:
        (tmp_path / "wattwatch.toml").write_text(f"interval_s = {value}\n")
        named = "interval_s = "
    line = _one_line(_run(argv, tmp_path, env))
    assert line.startswith(f"wattwatch {command}: error: {named}"), line
    assert line.endswith("the sampling tick is 0.05 to 3600 seconds"), line


@pytest.mark.parametrize(
    ("var", "value", "allowed"),
    [
        ("WATTWATCH_PUSH_INTERVAL", "0.01", "0.1 to 3600 seconds"),
        ("WATTWATCH_PUE", "0.5", "the PUE is 1"),
        ("WATTWATCH_GRID_INTENSITY", "inf", "0 to 5000 gCO2e/kWh"),
        ("WATTWATCH_PRICE_PER_KWH", "-0.1", "the price"),
        ("WATTWATCH_CPU_TDP", "lots", "the CPU TDP"),
        ("WATTWATCH_RETENTION_DAYS", "-1", "36500 days"),
        ("WATTWATCH_TIME_WINDOW_PAST", "0", "--time-window-past 30d"),
        ("WATTWATCH_HOST_SILENT_AFTER", "nan", "a host is silent after"),
    ],
)
def test_every_numeric_setting_is_checked_from_the_environment(
    tmp_path: Path, var: str, value: str, allowed: str
) -> None:
    line = _one_line(_run(["collector"], tmp_path, {var: value}))
    assert line.startswith(f"wattwatch collector: error: {var}={value} is "), line
    assert allowed in line, line


def test_flags_go_through_the_same_checks(tmp_path: Path) -> None:
    line = _one_line(_run(["agent", "--simulate", "1", "--push-interval", "nan"], tmp_path))
    assert line == (
        "wattwatch agent: error: --push-interval nan is not a finite number; the push interval is 0.1 to 3600 seconds"
    )
    line = _one_line(_run(["collector", "--retention-days", "1e9"], tmp_path))
    assert line.startswith("wattwatch collector: error: --retention-days 1e9 is out of range;"), line
    line = _one_line(_run(["collector", "--time-window-future", "0s"], tmp_path))
    assert "--time-window-future 0s is out of range" in line and "positive" in line, line


def test_a_toml_value_of_the_wrong_type_is_named_with_its_file(tmp_path: Path) -> None:
    (tmp_path / "wattwatch.toml").write_text("pue = true\n")
    line = _one_line(_run(["report", "--db", f"sqlite:///{tmp_path / 'w.db'}"], tmp_path))
    assert f"pue = True in {tmp_path / 'wattwatch.toml'} is not a number" in line, line


def test_a_config_file_that_cannot_be_read_is_one_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"pue = 1.2  # \xe9\n")
    cases = {
        str(tmp_path / "missing.toml"): "does not exist",
        str(tmp_path): "is not a file",
        str(bad): "cannot read config file",
    }
    for named, said in cases.items():
        with pytest.raises(ConfigError, match=said):
            load_settings(env={"WATTWATCH_HOME": str(tmp_path), "WATTWATCH_CONFIG": named})
    # Unset or empty: the home's wattwatch.toml if there is one, defaults if not.
    unset = load_settings(env={"WATTWATCH_HOME": str(tmp_path), "WATTWATCH_CONFIG": ""})
    assert unset.pue == Settings(home=tmp_path).pue
    line = _one_line(_run(["report"], tmp_path, {"WATTWATCH_CONFIG": str(tmp_path / "missing.toml")}))
    assert line.startswith("wattwatch report: error: config file ") and "does not exist" in line, line


def test_the_home_comes_from_the_environment_or_the_flag_never_from_its_own_file(tmp_path: Path) -> None:
    (tmp_path / "wattwatch.toml").write_text(f'home = "{tmp_path / "elsewhere"}"\n')
    with pytest.raises(ConfigError, match="home cannot be set in"):
        load_settings(env={"WATTWATCH_HOME": str(tmp_path)})


def test_a_secret_of_the_wrong_type_in_toml_is_named_without_its_value(tmp_path: Path) -> None:
    (tmp_path / "wattwatch.toml").write_text("token = 918273645\n")
    with pytest.raises(ConfigError, match=r"token = \(hidden\) in .* is not a string") as caught:
        load_settings(env={"WATTWATCH_HOME": str(tmp_path)})
    assert "918273645" not in str(caught.value)


def test_every_numeric_setting_has_a_range_and_refuses_nan_and_infinity(tmp_path: Path) -> None:
    numeric = {
        name
        for name, default in vars(Settings(home=tmp_path)).items()
        if isinstance(default, (int, float)) and not isinstance(default, bool)
    }
    assert numeric == set(RANGES)
    for name in RANGES:
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError, match=f"^{ENV_VARS[name]}={bad} is not a finite number; "):
                load_settings({"WATTWATCH_HOME": str(tmp_path), ENV_VARS[name]: bad})


def test_every_setting_has_a_variable_and_a_documented_form(tmp_path: Path) -> None:
    names = set(vars(Settings(home=tmp_path))) - {"home"}
    assert set(ENV_VARS) == names
    assert set(RANGES) | set(SWITCHES) | set(TEXT_FORMS) == names
    assert not set(RANGES) & set(SWITCHES) and not (set(RANGES) | set(SWITCHES)) & set(TEXT_FORMS)


def test_yes_no_settings_take_the_usual_words_and_refuse_others(tmp_path: Path) -> None:
    env = {"WATTWATCH_HOME": str(tmp_path)}
    for word, meant in (("1", True), ("Yes", True), ("on", True), ("0", False), ("false", False), ("off", False)):
        assert load_settings({**env, "WATTWATCH_KUBELET_INSECURE": word}).kubelet_insecure is meant
    line = _one_line(_run(["agent", "--simulate", "1"], tmp_path, {"WATTWATCH_DISCOVER": "2"}))
    assert line.startswith("wattwatch agent: error: WATTWATCH_DISCOVER=2 is not a yes/no value; use 1 or 0"), line
    with pytest.raises(ConfigError, match=r"^setting discover='maybe' is not a yes/no value"):
        Settings(home=tmp_path, discover="maybe")  # type: ignore[arg-type]


def test_good_values_from_each_source_are_numbers_and_the_flag_wins(tmp_path: Path) -> None:
    (tmp_path / "wattwatch.toml").write_text("interval_s = 2\npue = 1.2\n")
    env = {"WATTWATCH_HOME": str(tmp_path), "WATTWATCH_INTERVAL": "0.5"}
    assert load_settings(env).interval_s == 0.5 and load_settings(env).pue == 1.2
    flagged = load_settings(env, flags={"interval_s": ("--interval 0.25", "0.25")})
    assert flagged.interval_s == 0.25 and isinstance(flagged.interval_s, float)


def test_settings_made_in_code_are_checked_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^setting interval_s=0 is out of range; the sampling tick"):
        Settings(home=tmp_path, interval_s=0)
    with pytest.raises(ConfigError, match="setting pue='high' is not a number"):
        Settings(home=tmp_path, pue="high")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["agent", "--simulate", "1", "--fine-interval", "nan"], "fine tick"),
        (["up", "--simulate", "1", "--fine-interval", "inf"], "fine tick"),
        (["run", "--summary-wait", "nan", "--", "true"], "--summary-wait"),
        (["demo", "--duration", "inf"], "--duration"),
        (["top", "--once", "--interval", "nan"], "--interval"),
    ],
    ids=lambda a: " ".join(a[:3]) if isinstance(a, list) else a,
)
def test_the_commands_own_numeric_flags_refuse_nan_and_infinity(tmp_path: Path, argv: list[str], named: str) -> None:
    assert named in _one_line(_run(argv, tmp_path))
