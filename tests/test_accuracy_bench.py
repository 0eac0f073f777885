"""A fast run of benchmarks/accuracy.py on a reduced trace set: the stated accuracy bounds hold."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import accuracy  # lives in benchmarks/, importable once the path above is set


@pytest.fixture(scope="module")
def report() -> accuracy.Report:
    path_before = os.environ.get("PATH")
    result = accuracy.run(quick=True)
    assert os.environ.get("PATH") == path_before  # the nvidia-smi stub is gone again
    return result


def test_counter_path_meets_the_bounds(report: accuracy.Report) -> None:
    counter = [r for r in report.rows if r.path == "counter"]
    assert counter and any(r.has_reset for r in counter)
    for row in counter:
        err = row.errors["wattwatch"]
        assert isinstance(err, float), row
        assert abs(err) <= (accuracy.RESET_BOUND if row.has_reset else accuracy.COUNTER_BOUND), row


def test_power_path_is_no_worse_than_the_naive_10hz_trapezoid(report: accuracy.Report) -> None:
    power = [r for r in report.rows if r.path == "power"]
    assert power
    for row in power:
        ours, naive = row.errors["wattwatch"], row.errors["naive 10 Hz"]
        assert isinstance(ours, float) and isinstance(naive, float), row
        assert abs(ours) <= abs(naive), row


def test_codecarbon_measured_the_same_simulated_gpu(report: accuracy.Report) -> None:
    for row in report.rows:
        assert isinstance(row.errors["CodeCarbon"], float), row  # a number, not the reason it could not run
    steady = next(r for r in report.rows if r.path == "counter" and r.trace.startswith("steady"))
    err = steady.errors["CodeCarbon"]
    assert isinstance(err, float) and abs(err) < 0.05  # it reads the same counter: close on a steady 10 s job


def test_rapl_double_wrap_is_measured_only_when_read_often_enough(report: accuracy.Report) -> None:
    rows = {name: (measured, flagged) for name, measured, flagged in report.rapl_rows}
    good, flagged = rows["wattwatch, read at max_poll_interval_s"]
    assert isinstance(good, float) and good == pytest.approx(report.rapl_exact_j, rel=1e-3) and not flagged
    slow, flagged = rows["wattwatch, read every 30 s (too slow)"]
    assert isinstance(slow, float) and slow < 0.5 * report.rapl_exact_j and flagged
    assert report.passed
    text = accuracy.format_report(report, ["--quick"])
    assert text.startswith("`python benchmarks/accuracy.py --quick`")
    assert "| trace " in text and "\nAcceptance:" in text and "FAIL" not in text


def test_gpu_check_runs_its_measurements_on_a_simulated_board(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpu_check

    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--simulate", "--steady-s", "5", "--bursty-s", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["simulated"] is True
    dev = report["device"]
    assert dev["model"] == "NVIDIA H100 80GB HBM3" and dev["energy_counter"] and dev["power_instant"]
    upd = report["update_periods_under_load"]
    assert upd["counter"]["median_gap_s"] == pytest.approx(0.1, abs=0.002)
    assert upd["instant_changes_at_counter_updates"] < 0.3  # live instant power
    usage = report["step_idle_to_load"]["power_usage"]
    assert usage["t90_s"] > 0.5  # the 1 s average lags the step
    assert usage["window_s"] == pytest.approx(1.0, abs=0.05)  # the H100 preset's averaging window
    learned = report["learned_timing"]
    assert learned["refresh_period_s"] == pytest.approx(0.1, rel=1e-3) and learned["instant_power"] == "live"
    assert learned["process_sample_period_s"] == pytest.approx(1 / 6, rel=1e-3)  # this process's samples
    assert report["process_samples"]["min_gap_s"] == pytest.approx(1 / 6, rel=1e-3)
    printed = capsys.readouterr().out
    assert "`python benchmarks/gpu_check.py --simulate --steady-s 5 --bursty-s 3 --json" in printed
    assert "| counter refresh period" in printed and "| PowerUsage averaging window" in printed
    for section in ("steady_load", "bursty_load_50ms"):
        errors = report[section]["vs_reference"]
        assert abs(errors["wattwatch NvmlSensor (counter, boundary reads)"]) < 0.005, section
    # In step with the 100 ms refresh, 50 ms bursts fool the 10 Hz sampler but not the counter.
    assert abs(report["bursty_load_50ms"]["vs_reference"]["POWER_INSTANT 10 Hz trapezoid"]) > 0.05


def test_gpu_check_prints_raw_timings_beside_what_the_sensor_learned_on_a_flawed_board(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A simulated board refreshing every 20 ms with slow NVML calls (0.5 ms + 0.2 ms tail): the raw
    polling and the sensor find the same period, and both time the calls at 0.5 ms or more."""
    import gpu_check

    out = tmp_path / "gpu_check.json"
    flaws = "refresh_ms=20,latency_ms=0.5,jitter_ms=0.2,noise_w=5"
    args = ["--simulate", "--sim-flaws", flaws, "--steady-s", "2", "--bursty-s", "2", "--json", str(out)]
    assert gpu_check.main(args) == 0
    report = json.loads(out.read_text())
    assert report["sim_flaws"] == flaws
    assert report["update_periods_under_load"]["counter"]["median_gap_s"] == pytest.approx(0.02, abs=0.003)
    learned = report["learned_timing"]
    assert learned["refresh_period_s"] == pytest.approx(0.02, rel=1e-3)
    raw_median_s = report["call_latency"]["counter"]["median_s"]
    assert 0.0005 <= raw_median_s <= 0.0009
    median_s, _p95_s, calls = learned["call_latency_s"]
    assert median_s == pytest.approx(raw_median_s, rel=0.25) and calls > 100
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ")
    }
    assert rows["counter refresh period"][2].startswith("20.0")  # learned, beside the raw figure
    assert rows["NVML call latency: median (p95)"][1].startswith("counter 0.")
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--simulate", "--sim-flaws", "gremlins"])
    assert exit_info.value.code == 2


def test_gpu_check_sees_part_time_sampling(tmp_path: Path) -> None:
    import gpu_check

    out = tmp_path / "gpu_check.json"
    args = ["--simulate", "--generation", "h100-parttime", "--steady-s", "2", "--bursty-s", "2", "--json", str(out)]
    assert gpu_check.main(args) == 0
    report = json.loads(out.read_text())
    assert report["update_periods_under_load"]["instant_changes_at_counter_updates"] > 0.9  # held between updates
    assert report["learned_timing"]["instant_power"] == "held"


def test_gpu_check_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_check
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert gpu_check.main([]) == 2
        assert "try --simulate" in capsys.readouterr().err
    else:  # a machine with a GPU: the real check belongs to the device run, not the unit tests
        pynvml.nvmlShutdown()
        pytest.skip("a real GPU is present")
