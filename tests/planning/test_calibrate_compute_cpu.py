"""The compute's CPU time calibrated from a real profiled PS run (two workers and a PS train a small MLP), the plan
model that uses it reproducing that run, a capture whose table predates it, and a hand-built capture where another
program kept one worker off the cores for half the window: the steps of both workers together set the rate, and the
plan reproduces the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from shardflow.planning.calibrate import Calibration, calibrate
from shardflow.planning.plan_model import PlanConfig
from shardflow.planning.strategies import predict_strategy
from shardflow.profile import spans
from shardflow.profile.capture import EVENTS, MERGED, capture_dir, write_capture
from shardflow.profile.memory import CPU_CORES

JOB = Path(__file__).parents[1] / "cli" / "jobs" / "tiny_classifier.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two workers and one PS train the tiny job for 2000 steps, profiling steps [200, 1800): about 1.6 s, 160 samples
    of the cores' counters (every 10 ms). A window of 150 steps (60 ms) left the CPU time of the window to 6 samples,
    10% off when another program shared the cores; one of 600 steps planned its own run 18% slow in a fresh-clone CI
    run (3 test processes beside it on 2 cores)."""
    directory = tmp_path_factory.mktemp("compute-cpu")
    env = {
        **os.environ,
        "SHARDFLOW_MODEL_DIR": str(directory / "model"),
        "SHARDFLOW_RESULT_JSON": str(directory / "result.json"),
        "SHARDFLOW_PROFILE_STEPS": "200,1800",
    }
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", "1", str(JOB), "2000", "2500"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return directory / "model"


@pytest.fixture(scope="module")
def measured(model_dir: Path) -> Calibration:
    return calibrate(model_dir)


def test_a_ps_run_calibrates_the_cpu_time_of_its_compute_within_its_wall_time(measured):
    # Per step the CPU time of forward and backward is at most their wall time; the pushes that backward's hooks
    # start come off both.
    assert measured.step_compute_cpu_s is not None
    assert 0 < measured.step_compute_cpu_s <= measured.step_compute_s


def test_a_ps_calibration_with_the_compute_cpu_time_reproduces_its_own_run(measured):
    assert measured.busy_cores is not None
    config = _plan_of_its_own_run(measured)
    predicted = predict_strategy(config, "ps").global_steps_per_s
    # Alone on the machine, within 0.5%; beside busy loops that come and go, within 4% in twelve runs. Two CI runs
    # had planned +16% and +54%: the workers' rate was the sum of each one's over its own window, so a worker kept
    # off the cores at the start counted that time as work (test_calibrate_ps_rate.py).
    assert predicted == pytest.approx(measured.global_steps_per_s, rel=0.15)


def test_a_capture_whose_table_predates_the_cpu_time_calibrates_without_it(model_dir, measured, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(capture_dir(model_dir), old)
    table = pq.read_table(old / EVENTS)
    pq.write_table(table.drop_columns(["cpu_ns"]), old / EVENTS)
    os.utime(old / EVENTS, (os.stat(old / MERGED).st_mtime + 1,) * 2)  # newer than the trace: not rebuilt
    calibrated = calibrate(old)
    assert calibrated.step_compute_cpu_s is None
    assert calibrated.step_compute_s == measured.step_compute_s


def _plan_of_its_own_run(measured: Calibration) -> PlanConfig:
    """The plan model's inputs, every one from the calibration of a run, on the cores that run's roles got."""
    return PlanConfig(
        num_params=measured.model_bytes / 4,
        num_workers=measured.num_workers,
        num_ps=measured.num_ps,
        bandwidth=measured.bandwidth,
        step_compute_s=measured.step_compute_s,
        step_compute_cpu_s=measured.step_compute_cpu_s,
        ps_apply_s=measured.ps_apply_s,
        cores=measured.busy_cores,
        worker_cpu_s=measured.worker_cpu_s,
        ps_cpu_s=measured.ps_cpu_s,
        other_cores=measured.other_cores,
        calibrated_on=measured.strategy,
    )


# -- a hand-built capture: another program kept one worker off the cores for half the window --------------------
MODEL_BYTES = 100_000
WINDOW_US = 20_000.0
PERIOD_US = 1000.0
LATE_US = 10_000.0
"""worker:1 gets no core for the first half of the window, then steps as worker:0 does."""
CORES = {"worker:0": [0.5] * 21, "worker:1": [0.0] * 11 + [0.5] * 10, "ps:0": [0.25] * 21}
"""`cpu.cores` each millisecond (a value covers the millisecond before it): 0.75 of a core in all over 20 ms."""


def _trace(role: str, events: list[dict[str, Any]], last_step: int) -> dict[str, Any]:
    counters = [
        {"ph": "C", "name": CPU_CORES, "ts": i * PERIOD_US, "tid": 0, "args": {"value": value}}
        for i, value in enumerate(CORES[role])
    ]
    head = {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": role}}
    info = {"clock_offset_us": 0.0, "clock_error_us": 0.0, "first_step": 0, "last_step": last_step, "complete": True}
    return {
        "traceEvents": [{**e, "pid": 0} for e in [head, *events, *counters]],
        "otherData": {"base_time_ns": 0, "roles": {role: info}},
    }


def _span(name: str, ts: float, dur: float, step: int, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 0, "args": {"step": step, **args}}


def _worker(starts: list[float]) -> list[dict[str, Any]]:
    events = []
    for step, start in enumerate(starts):
        events += [
            _span(spans.FORWARD, start, 200.0, step, cpu_ns=150_000),
            _span(spans.BACKWARD, start + 200, 300.0, step, cpu_ns=250_000),
            _span(spans.PUSH, start + 500, 100.0, step, bytes=MODEL_BYTES),
            _span(spans.PULL_WAIT, start + 600, 300.0, step, bytes=MODEL_BYTES),
            _span(spans.STEP, start, 1000.0, step),
        ]
    return events


def _ps(applies: list[float]) -> list[dict[str, Any]]:
    events = []
    for step, start in enumerate(applies):
        events += [
            _span(spans.RECEIVE, start, 50.0, step, bytes=MODEL_BYTES),
            _span(spans.APPLY, start + 50, 100.0, step, bytes=MODEL_BYTES),
            _span(spans.REPLY, start + 150, 50.0, step),
        ]
    return events


@pytest.fixture
def hand_built(tmp_path: Path) -> Calibration:
    early = [i * PERIOD_US for i in range(20)]
    late = [LATE_US + i * PERIOD_US for i in range(10)]
    applies = sorted(t + 550 for t in early + late)
    traces = [
        _trace("worker:0", _worker(early), 20),
        _trace("worker:1", _worker(late), 10),
        _trace("ps:0", _ps(applies), 30),
    ]
    return calibrate(write_capture(traces, tmp_path / "profile" / "ps"))


def test_a_worker_kept_off_the_cores_for_half_the_window_does_not_double_the_rate(hand_built):
    # 30 worker steps in 19 ms (less one a worker): not 1000 + 1000 steps/s, each worker's over its own window.
    assert hand_built.global_steps_per_s == pytest.approx(29 / 19e-3)
    # 0.5 + 0.25 cores of the workers over (30 - 2) steps in 19 ms.
    assert hand_built.worker_cpu_s == pytest.approx(0.75 / (28 / 19e-3))
    assert hand_built.ps_cpu_s == pytest.approx(0.25 / (28 / 19e-3))


def test_the_plan_from_that_capture_reproduces_its_run(hand_built):
    assert hand_built.busy_cores == pytest.approx(1.0)
    assert hand_built.step_compute_cpu_s is not None
    config = _plan_of_its_own_run(hand_built)
    # Bound by the cores: 1 core over 1 ms of CPU per worker step. The sum of the workers' own rates said 2000.
    prediction = predict_strategy(config, "ps")
    assert prediction.bound == "CPU cores"
    assert prediction.global_steps_per_s == pytest.approx(hand_built.global_steps_per_s, rel=0.05)
