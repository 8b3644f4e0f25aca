"""Calibration from a hybrid run's capture (2 workers, hand-built with known timings, merged as the chief merges real
ones), the rows a PS run of a model with tables pushes, and hybrid predicted from them."""

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardflow.cli.main import main
from shardflow.planning.calibrate import Calibration, calibrate
from shardflow.planning.plan_model import HybridCost, PlanConfig
from shardflow.planning.strategies import predict_strategy, ring_bytes
from shardflow.profile import spans
from shardflow.profile.capture import write_capture
from shardflow.profile.memory import CPU_CORES

DENSE_BYTES = 20_000
ROW_BYTES = 130_000
NUM_STEPS = 8
PERIOD_US = 3000.0
# One hybrid step, in µs from its start: (span, start, duration, bytes). The rows go to the PS and the worker waits
# for them to be taken (600 µs), then the all-reduce copies for 100 µs and waits 900 µs for its one bucket.
HYBRID_STEP = [
    (spans.INPUT_WAIT, 0.0, 10.0, None),
    (spans.FORWARD, 10.0, 400.0, None),
    (spans.BACKWARD, 410.0, 600.0, None),
    (spans.PUSH, 1010.0, 100.0, ROW_BYTES),
    (spans.PULL_WAIT, 1110.0, 500.0, 0),
    (spans.ALLREDUCE, 1610.0, 1000.0, DENSE_BYTES),
    (spans.APPLY, 2610.0, 200.0, DENSE_BYTES),
    (spans.STEP, 0.0, 3000.0, None),
]
COMPUTE_CPU_NS = {spans.FORWARD: 350_000, spans.BACKWARD: 550_000}
"""The CPU time of the thread that ran forward and backward: 900 µs of their 1000."""
CPU_CORES_PER_WORKER = 0.8
"""2400 µs of CPU per 3000 µs step: 1400 µs of its own part, 1000 µs in the ring."""


def _trace(role: str, step_spans: list[tuple[str, float, float, int | None]], extra=()) -> dict[str, Any]:
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": role}}]
    for step in range(NUM_STEPS):
        start = step * PERIOD_US
        for name, offset, duration, nbytes in step_spans:
            args = {"step": step, **({"bytes": nbytes} if nbytes is not None else {})}
            args |= {"cpu_ns": COMPUTE_CPU_NS[name]} if name in COMPUTE_CPU_NS else {}
            events.append({"ph": "X", "name": name, "ts": start + offset, "dur": duration, "tid": 0, "args": args})
        for event in extra:
            events.append({**event(step), "ts": start + event(step)["ts"]})
    events += [
        {"ph": "C", "name": CPU_CORES, "ts": step * PERIOD_US, "tid": 0, "args": {"value": CPU_CORES_PER_WORKER}}
        for step in range(NUM_STEPS + 1)
    ]
    info = {"clock_offset_us": 0.0, "clock_error_us": 0.0, "first_step": 0, "last_step": NUM_STEPS, "complete": True}
    return {"traceEvents": [{**e, "pid": 0} for e in events], "otherData": {"base_time_ns": 0, "roles": {role: info}}}


def _bucket(step: int) -> dict[str, Any]:
    args = {"step": step, "bucket": 0, "bytes": DENSE_BYTES}
    return {"ph": "X", "name": spans.ALLREDUCE_BUCKET, "ts": 1710.0, "dur": 900.0, "tid": 1, "args": args}


@pytest.fixture
def hybrid_capture(tmp_path: Path) -> Path:
    traces = [_trace(f"worker:{i}", HYBRID_STEP, [_bucket]) for i in range(2)]
    return write_capture(traces, tmp_path / "profile" / "hybrid")


@pytest.fixture
def hybrid(hybrid_capture: Path) -> Calibration:
    return calibrate(hybrid_capture)


def _config(measured: Calibration, num_workers: int, **fields: Any) -> PlanConfig:
    return PlanConfig(
        num_params=measured.model_bytes / 4,
        num_workers=num_workers,
        num_ps=1,
        bandwidth=measured.bandwidth,
        step_compute_s=measured.step_compute_s,
        sparse_params=measured.sparse_bytes / 4,
        hybrid=measured.hybrid,
        calibrated_on=measured.strategy,
        **fields,
    )


def test_a_hybrid_capture_splits_a_step_into_its_own_part_the_ps_wait_and_the_allreduce(hybrid):
    assert (hybrid.strategy, hybrid.num_workers, hybrid.num_ps) == ("hybrid", 2, 1)
    assert hybrid.hybrid is not None
    assert hybrid.hybrid.own_s == pytest.approx(1400e-6)
    assert hybrid.hybrid.push_wait_s == pytest.approx(600e-6)
    assert hybrid.hybrid.allreduce_s == pytest.approx(1000e-6)
    assert hybrid.hybrid.copy_s == pytest.approx(100e-6)


def test_a_hybrid_capture_calibrates_the_cpu_time_of_its_compute(hybrid):
    assert hybrid.step_compute_cpu_s == pytest.approx(900e-6)


def test_a_hybrid_capture_measures_the_rows_pushed_and_the_dense_part_all_reduced(hybrid):
    assert hybrid.sparse_bytes == ROW_BYTES
    assert hybrid.model_bytes == ROW_BYTES + DENSE_BYTES


def test_a_hybrid_workers_cpu_beyond_its_own_part_is_the_rings(hybrid):
    assert hybrid.hybrid is not None
    assert hybrid.hybrid.ring_cpu_per_byte == pytest.approx(1000e-6 / ring_bytes(2, DENSE_BYTES))


def test_a_hybrid_capture_counts_the_ps_cores_as_the_workers_waits_for_it(hybrid):
    # No PS in the capture: its work is what the workers waited for, 600 µs per round of 3000 µs.
    assert hybrid.busy_cores == pytest.approx(2 * CPU_CORES_PER_WORKER + 600 / PERIOD_US)


def test_a_hybrid_capture_with_its_ps_counts_their_cores_and_not_their_applies(tmp_path):
    # Each PS's part: its applies of the rows, and the cores it sampled (0.15), which stand for the workers' waits.
    ps_step: list[tuple[str, float, float, int | None]] = [
        (spans.RECEIVE, 1050.0, 50.0, ROW_BYTES),
        (spans.APPLY, 1100.0, 400.0, ROW_BYTES),
    ]
    workers = [_trace(f"worker:{i}", HYBRID_STEP, [_bucket]) for i in range(2)]
    servers = [_trace(f"ps:{k}", ps_step) for k in range(2)]
    for event in (e for trace in servers for e in trace["traceEvents"] if e["ph"] == "C"):
        event["args"] = {"value": 0.15}
    measured = calibrate(write_capture(workers + servers, tmp_path / "profile" / "hybrid-with-ps"))
    assert measured.busy_cores == pytest.approx(2 * CPU_CORES_PER_WORKER + 0.3)
    assert measured.ring is not None and measured.ring.apply_s == pytest.approx(200e-6)  # the workers' apply only


def test_a_hybrid_calibration_reproduces_its_own_run_and_says_so(hybrid):
    prediction = predict_strategy(_config(hybrid, 2, cores=hybrid.busy_cores), "hybrid")
    assert prediction.calibration == "hybrid run"
    assert prediction.global_steps_per_s == pytest.approx(1e6 / PERIOD_US)


def test_hybrid_waits_for_every_push_the_busiest_ps_takes_and_rings_more_bytes(hybrid):
    four = predict_strategy(_config(hybrid, 4), "hybrid")
    # The PS takes 4 pushes a round instead of 2; the ring moves 2(4-1)/4 = 1.5x the dense part instead of 1x.
    assert four.round_s == pytest.approx((1400 + 2 * 600 + 100 + 1.5 * 900) * 1e-6)
    two_ps = predict_strategy(replace(_config(hybrid, 4), num_ps=2), "hybrid")
    assert two_ps.round_s == pytest.approx((1400 + 600 + 100 + 1.5 * 900) * 1e-6)


def test_one_hybrid_worker_copies_into_its_buckets_and_rings_nothing(hybrid):
    one = predict_strategy(_config(hybrid, 1), "hybrid")
    assert one.round_s == pytest.approx((1400 + 300 + 100) * 1e-6)


def test_with_shared_cores_hybrid_is_bound_by_every_workers_cpu_and_the_ps(hybrid):
    prediction = predict_strategy(_config(hybrid, 4, cores=1.0, refill_s_per_byte=0.0), "hybrid")
    # The run's ring took 1000 us of CPU for 2 messages of the dense part's bytes: the bytes' copies at the run's
    # bandwidth, the rest per message. 4 workers send 6 messages of 1.5x the bytes.
    copies = 2 * DENSE_BYTES / hybrid.bandwidth
    assert 0 < copies < 1000e-6
    ring_cpu = (1000e-6 - copies) / 2 * 6 + copies * ring_bytes(4, DENSE_BYTES) / DENSE_BYTES
    cpu_per_worker = 2400e-6 - 1000e-6 + ring_cpu + 300e-6
    assert prediction.bound == "CPU cores"
    assert prediction.round_s == pytest.approx(4 * cpu_per_worker)
    # 5 roles on the core against the run's 3: 2 more beyond it, reloading all the bytes on each worker, the rows on
    # the PS.
    reloading = predict_strategy(_config(hybrid, 4, cores=1.0, refill_s_per_byte=1e-9), "hybrid")
    model_bytes, rows = hybrid.model_bytes, hybrid.sparse_bytes
    assert reloading.round_s == pytest.approx(4 * (cpu_per_worker + 2 * 1e-9 * (model_bytes + rows)))


def test_hybrid_cost_refuses_a_negative_wait():
    with pytest.raises(ValueError, match=r"HybridCost.push_wait_s must be >= 0"):
        HybridCost(own_s=0.001, push_wait_s=-1.0, allreduce_s=0.001, calibrated_workers=2)


PS_WORKER_STEP = [
    (spans.FORWARD, 10.0, 400.0, None),
    (spans.BACKWARD, 410.0, 600.0, None),
    (spans.PUSH, 1010.0, 100.0, ROW_BYTES + DENSE_BYTES),
    (spans.PULL_WAIT, 1110.0, 800.0, DENSE_BYTES),
    (spans.STEP, 0.0, 2000.0, None),
]
PS_STEP = [
    (spans.RECEIVE, 1100.0, 50.0, ROW_BYTES + DENSE_BYTES),
    (spans.APPLY, 1150.0, 500.0, ROW_BYTES + DENSE_BYTES),
    (spans.REPLY, 1650.0, 50.0, None),
]


def test_a_ps_run_of_a_model_with_tables_pushes_rows_beyond_the_dense_part_it_pulls(tmp_path):
    capture = write_capture([_trace("worker:0", PS_WORKER_STEP), _trace("ps:0", PS_STEP)], tmp_path / "p" / "ps")
    measured = calibrate(capture)
    assert (measured.strategy, measured.sparse_bytes) == ("ps", ROW_BYTES)


def test_plan_calibrate_hybrid_predicts_hybrid_from_its_run_and_the_ps_from_the_rest(hybrid_capture, capsys):
    args = ["--params", "37.5K", "--workers", "4", "--ps", "1", "--bandwidth", "8Gbit", "--step-compute", "1ms"]
    assert main(["plan", *args, "--calibrate-hybrid", str(hybrid_capture.parent.parent)]) == 0
    out = capsys.readouterr().out
    assert "(hybrid, 2 workers, 1 PS)" in out and "push and PS wait" in out
    rows = {line.split()[0]: line.rstrip() for line in out.splitlines() if re.search(r" moves |moves nothing", line)}
    assert rows["PS"].endswith("given") and rows["hybrid"].endswith("hybrid run")


def test_other_programs_demand_is_counted_in_the_jobs_busy_roles(tmp_path):
    # The job's 3 roles kept 1.5 cores busy while the machine's were 2.0: others' 0.5 is a third of the job's demand.
    measured = Calibration(
        capture=tmp_path,
        num_workers=2,
        num_ps=1,
        model_bytes=1e6,
        step_compute_s=0.001,
        bandwidth=1e9,
        ps_apply_s=0.001,
        worker_step_s=0.002,
        global_steps_per_s=500.0,
        busy_cores=1.5,
        machine_busy_cores=2.0,
    )
    assert measured.contending_roles == pytest.approx(1.0)


def test_more_busy_roles_take_more_of_a_shared_machine():
    config = PlanConfig(num_params=1e6, num_workers=2, num_ps=1, bandwidth=1e9, step_compute_s=0.01, cores=2.0)
    assert config.job_cores(3) == 2.0
    shared = replace(config, contending_roles=1.0)
    assert shared.job_cores(3) == pytest.approx(1.5)
    assert shared.job_cores(5) == pytest.approx(2 * 5 / 6)


def test_a_ring_whose_cpu_its_bytes_explain_grows_with_its_bytes_alone(hybrid):
    # 1 ns per ring byte is below the copies at the run's bandwidth: no cost per message, the ring CPU grows 1.5x.
    assert hybrid.hybrid is not None and 2 / hybrid.bandwidth > 1e-9
    cost = replace(hybrid.hybrid, ring_cpu_per_byte=1e-9)
    config = replace(_config(hybrid, 4, cores=1.0, refill_s_per_byte=0.0), hybrid=cost)
    more_ring_cpu = 1e-9 * (ring_bytes(4, DENSE_BYTES) - DENSE_BYTES)
    assert predict_strategy(config, "hybrid").round_s == pytest.approx(4 * (2400e-6 + more_ring_cpu + 300e-6))


def _table_counters(values: dict[str, list[float]]) -> list[dict[str, Any]]:
    """A PS's `table/<name>/values_bytes` counters, sampled in turn (the last one counts: a dynamic table grows)."""
    return [
        {"ph": "C", "name": f"table/{name}/values_bytes", "ts": 100.0 * i, "pid": 0, "tid": 0, "args": {"value": v}}
        for name, samples in values.items()
        for i, v in enumerate(samples)
    ]


def test_a_ps_run_counts_its_tables_in_full_and_plan_has_all_reduce_sum_them(tmp_path, capsys):
    server = _trace("ps:0", PS_STEP)
    # A 10M x 16 item table and a dynamic table grown to 1000 rows of 8: the rows a step pushes are far fewer.
    server["traceEvents"] += _table_counters({"item": [640e6, 640e6], "users": [16e3, 32e3]})
    capture = write_capture([_trace("worker:0", PS_WORKER_STEP), server], tmp_path / "p" / "ps")
    measured = calibrate(capture)
    assert measured.table_bytes == 640e6 + 32e3
    assert main(["plan", "--calibrate", str(capture), "--workers", "4", "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sf\.nn tables +640 MB +in full on the PS", out)
    # All-reduce sums every table in full, 2(4-1)/4 of them each way: not the 130 kB of rows a PS step pushes.
    assert re.search(r"^all-reduce .* moves 960 MB each way per worker", out, re.MULTILINE)
    assert "winner: all-reduce" not in out


def test_a_capture_without_table_counters_leaves_the_tables_to_the_flags(tmp_path):
    capture = write_capture([_trace("worker:0", PS_WORKER_STEP), _trace("ps:0", PS_STEP)], tmp_path / "p" / "ps")
    assert calibrate(capture).table_bytes == 0.0


def test_a_hybrid_run_counts_the_tables_its_ps_hold(tmp_path):
    ps_step: list[tuple[str, float, float, int | None]] = [(spans.APPLY, 1100.0, 400.0, ROW_BYTES)]
    workers = [_trace(f"worker:{i}", HYBRID_STEP, [_bucket]) for i in range(2)]
    servers = [_trace(f"ps:{k}", ps_step) for k in range(2)]
    for k, server in enumerate(servers):
        server["traceEvents"] += _table_counters({"item": [320e6 + k]})
    measured = calibrate(write_capture(workers + servers, tmp_path / "profile" / "hybrid-tables"))
    assert measured.hybrid is not None and measured.table_bytes == 640e6 + 1
