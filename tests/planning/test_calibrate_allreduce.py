"""Calibration from an all-reduce run's capture: a hand-built one of 2 workers with known timings, merged as the
chief merges real ones, and the predictions made from it."""

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardflow.cli.main import main
from shardflow.planning.calibrate import calibrate
from shardflow.planning.plan_model import PlanConfig
from shardflow.planning.strategies import predict_strategy, ring_bytes
from shardflow.profile import spans
from shardflow.profile.capture import write_capture
from shardflow.profile.memory import CPU_CORES

MODEL_BYTES = 1_000_000
NUM_STEPS = 8
PERIOD_US = 4000.0
# One step of a worker, in µs from its start: (span, start, duration); its all-reduce copies for 100 µs, then
# issues the one bucket, whose wait ends with the all-reduce.
STEP_SPANS = [
    (spans.INPUT_WAIT, 0.0, 10.0),
    (spans.FORWARD, 10.0, 400.0),
    (spans.BACKWARD, 410.0, 600.0),
    (spans.ALLREDUCE, 1010.0, 1100.0),
    (spans.APPLY, 2110.0, 200.0),
    (spans.STEP, 0.0, 2400.0),
]
COMPUTE_CPU_NS = {spans.FORWARD: 300_000, spans.BACKWARD: 500_000}
"""The CPU time of the thread that ran forward and backward: 800 µs of their 1000."""
CPU_CORES_PER_WORKER = 0.75
"""Each worker keeps 0.75 of a core busy: 3 ms of CPU per 4 ms step."""


def _worker_trace(role: str) -> dict[str, Any]:
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": role}}]
    for step in range(NUM_STEPS):
        start = step * PERIOD_US
        for name, offset, duration in STEP_SPANS:
            args = {"step": step, **({"bytes": MODEL_BYTES} if name == spans.ALLREDUCE else {})}
            args |= {"cpu_ns": COMPUTE_CPU_NS[name]} if name in COMPUTE_CPU_NS else {}
            events.append({"ph": "X", "name": name, "ts": start + offset, "dur": duration, "tid": 0, "args": args})
        bucket = {"step": step, "bucket": 0, "bytes": MODEL_BYTES}
        events.append(
            {"ph": "X", "name": spans.ALLREDUCE_BUCKET, "ts": start + 1110, "dur": 1000, "tid": 1, "args": bucket}
        )
    events += [
        {"ph": "C", "name": CPU_CORES, "ts": step * PERIOD_US, "tid": 0, "args": {"value": CPU_CORES_PER_WORKER}}
        for step in range(NUM_STEPS + 1)
    ]
    info = {"clock_offset_us": 0.0, "clock_error_us": 0.0, "first_step": 0, "last_step": NUM_STEPS, "complete": True}
    return {"traceEvents": [{**e, "pid": 0} for e in events], "otherData": {"base_time_ns": 0, "roles": {role: info}}}


@pytest.fixture
def allreduce_capture(tmp_path: Path) -> Path:
    return write_capture([_worker_trace("worker:0"), _worker_trace("worker:1")], tmp_path / "profile" / "ar")


def test_an_allreduce_capture_calibrates_the_ring_from_its_time_less_the_copies(allreduce_capture):
    measured = calibrate(allreduce_capture)
    assert (measured.strategy, measured.num_workers, measured.num_ps) == ("allreduce", 2, 0)
    assert measured.model_bytes == MODEL_BYTES
    assert measured.step_compute_s == pytest.approx(1000e-6)
    assert measured.allreduce_s == pytest.approx(1100e-6)
    assert measured.global_steps_per_s == pytest.approx(1e6 / PERIOD_US)
    assert measured.ring is not None
    # 2 workers send 2(n-1)/n = 1x the model in the 1000 µs of the all-reduce after its 100 µs of copies.
    assert measured.ring.copy_s == pytest.approx(100e-6)
    assert measured.ring.bandwidth == pytest.approx(MODEL_BYTES / 1000e-6)
    assert measured.ring.apply_s == pytest.approx(200e-6)


def test_an_allreduce_capture_calibrates_the_cpu_time_of_its_compute(allreduce_capture):
    assert calibrate(allreduce_capture).step_compute_cpu_s == pytest.approx(800e-6)


def test_the_cpu_beyond_the_rest_of_the_step_is_the_rings_per_byte(allreduce_capture):
    ring = calibrate(allreduce_capture).ring
    assert ring is not None
    # 3000 µs of CPU per step; outside the all-reduce the step span holds 1300 µs, plus 100 µs of copies.
    assert ring.own_cpu_s == pytest.approx(1400e-6)
    assert ring.cpu_per_byte == pytest.approx(1600e-6 / MODEL_BYTES)


def test_an_allreduce_calibration_reproduces_its_own_run_and_says_so(allreduce_capture):
    measured = calibrate(allreduce_capture)
    config = PlanConfig(
        num_params=measured.model_bytes / 4,
        num_workers=2,
        num_ps=1,
        bandwidth=measured.bandwidth,
        step_compute_s=measured.step_compute_s,
        step_compute_cpu_s=measured.step_compute_cpu_s,
        cores=measured.busy_cores,
        ring=measured.ring,
        calibrated_on="allreduce",
    )
    prediction = predict_strategy(config, "allreduce")
    assert prediction.calibration == "all-reduce run"
    assert prediction.global_steps_per_s == pytest.approx(measured.global_steps_per_s)


def test_with_cores_the_ring_cpu_grows_with_the_ring_bytes(allreduce_capture):
    measured = calibrate(allreduce_capture)
    assert measured.ring is not None
    config = PlanConfig(
        num_params=measured.model_bytes / 4,
        num_workers=4,
        num_ps=1,
        bandwidth=measured.bandwidth,
        step_compute_s=measured.step_compute_s,
        cores=1.0,
        ring=measured.ring,
        refill_s_per_byte=0.0,
    )
    prediction = predict_strategy(config, "allreduce")
    cpu_per_worker = 1400e-6 + 1600e-6 / MODEL_BYTES * ring_bytes(4, MODEL_BYTES)
    assert prediction.bound == "CPU cores"
    assert prediction.round_s == pytest.approx(4 * cpu_per_worker / 1.0)
    # 4 workers on the core against the ring's run of 2: 2 roles more beyond it, each reloading the whole model.
    reloading = predict_strategy(replace(config, refill_s_per_byte=1e-9), "allreduce")
    assert reloading.round_s == pytest.approx(4 * (cpu_per_worker + 2 * 1e-9 * MODEL_BYTES))


def test_without_a_ring_allreduce_is_predicted_from_the_ps_calibration():
    config = PlanConfig(num_params=1e6, num_workers=4, num_ps=1, bandwidth=1e9, step_compute_s=0.01, ps_apply_s=0.002)
    assert predict_strategy(config, "allreduce").calibration == "given"
    assert predict_strategy(replace(config, calibrated_on="ps"), "allreduce").calibration == "PS run"


def test_a_one_worker_allreduce_capture_has_no_ring(tmp_path):
    capture = write_capture([_worker_trace("worker:0")], tmp_path / "profile" / "ar")
    assert calibrate(capture).ring is None


def test_plan_calibrated_on_an_allreduce_run_names_it_in_every_row(allreduce_capture, capsys):
    assert main(["plan", "--calibrate", str(allreduce_capture), "--workers", "4", "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert "(all-reduce, 2 workers)" in out and "ring bandwidth" in out
    rows = [line for line in out.splitlines() if re.match(r"(PS|all-reduce|hybrid) +[\d,.]+ +[\d,.]+ +moves", line)]
    assert len(rows) == 3 and all(row.rstrip().endswith("all-reduce run") for row in rows), out


def test_plan_refuses_to_calibrate_on_a_one_worker_allreduce_run(tmp_path, capsys):
    write_capture([_worker_trace("worker:0")], tmp_path / "profile" / "ar")
    assert main(["plan", "--calibrate", str(tmp_path), "--workers", "4"]) == 2
    assert "which all-reduces nothing: calibrate on one of 2 or more workers" in capsys.readouterr().err


def test_calibrate_allreduce_predicts_allreduce_from_its_run_and_the_ps_from_the_rest(allreduce_capture, capsys):
    args = ["--params", "250K", "--workers", "4", "--ps", "1", "--bandwidth", "8Gbit", "--step-compute", "1ms"]
    assert main(["plan", *args, "--calibrate-allreduce", str(allreduce_capture.parent.parent)]) == 0
    rows = {line.split()[0]: line.rstrip() for line in capsys.readouterr().out.splitlines() if " moves " in line}
    assert rows["PS"].endswith("given") and rows["all-reduce"].endswith("all-reduce run")
