"""The CPU a PS run's workers use per step, from a hand-built capture where another program kept one worker off the
cores for half the window: the steps of both workers together set the rate, and the plan reproduces the run."""

from pathlib import Path
from typing import Any

import pytest

from shardflow.planning.calibrate import Calibration, calibrate
from shardflow.planning.plan_model import PlanConfig
from shardflow.planning.strategies import predict_strategy
from shardflow.profile import spans
from shardflow.profile.capture import write_capture
from shardflow.profile.memory import CPU_CORES

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
def measured(tmp_path: Path) -> Calibration:
    early = [i * PERIOD_US for i in range(20)]
    late = [LATE_US + i * PERIOD_US for i in range(10)]
    applies = sorted(t + 550 for t in early + late)
    traces = [
        _trace("worker:0", _worker(early), 20),
        _trace("worker:1", _worker(late), 10),
        _trace("ps:0", _ps(applies), 30),
    ]
    return calibrate(write_capture(traces, tmp_path / "profile" / "ps"))


def test_a_worker_kept_off_the_cores_for_half_the_window_does_not_double_the_rate(measured):
    # 30 worker steps in 19 ms (less one a worker): not 1000 + 1000 steps/s, each worker's over its own window.
    assert measured.global_steps_per_s == pytest.approx(29 / 19e-3)
    # 0.5 + 0.25 cores of the workers over (30 - 2) steps in 19 ms.
    assert measured.worker_cpu_s == pytest.approx(0.75 / (28 / 19e-3))
    assert measured.ps_cpu_s == pytest.approx(0.25 / (28 / 19e-3))


def test_the_plan_from_that_capture_reproduces_its_run(measured):
    assert measured.busy_cores == pytest.approx(1.0)
    assert measured.step_compute_cpu_s is not None
    config = PlanConfig(
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
        calibrated_on=measured.strategy,
    )
    # Bound by the cores: 1 core over 1 ms of CPU per worker step. The sum of the workers' own rates said 2000.
    prediction = predict_strategy(config, "ps")
    assert prediction.bound == "CPU cores"
    assert prediction.global_steps_per_s == pytest.approx(measured.global_steps_per_s, rel=0.05)
