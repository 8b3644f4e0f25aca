"""Estimator(profile_steps=...) with sf.AllReduceStrategy on a real local cluster (a chief and two workers): every
worker's steps, with one span per all-reduce bucket, merged by the chief into one trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from shardflow.cli.main import main
from shardflow.planning.calibrate import calibrate
from shardflow.profile.spans import ALLREDUCE, ALLREDUCE_BUCKET, APPLY, BACKWARD, FORWARD, INPUT_WAIT, STEP

from .conftest import JobRun

FIRST, LAST = 4, 8
# The job's model holds 256, 64, 64 and 4 bytes of float32 parameters: buckets of 256, 128 and 4, and the 5 + 2
# flags of 2 workers ride in the first.
BUCKET_BYTES = 128
NUM_BUCKETS = 3
ALLREDUCED_BYTES = (4 * 16 + 16 + 16 + 1 + 5 + 2) * 4


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    """The model dir of one all-reduce run whose global steps [FIRST, LAST) were captured."""
    tmp = tmp_path_factory.mktemp("allreduce-profiled")
    run = JobRun(tmp)
    proc, result = run(
        "allreduce.py",
        env={"SHARDFLOW_PROFILE_STEPS": f"{FIRST},{LAST}"},
        num_workers=2,
        max_steps=12,
        num_batches=100,
        bucket_bytes=BUCKET_BYTES,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 12
    return tmp / "model"


def _spans_by_role(model_dir: Path) -> dict[str, list[dict]]:
    (merged,) = (model_dir / "profile").glob("*/merged.trace.json.gz")
    with gzip.open(merged) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    roles: dict[str, list[dict]] = {name: [] for name in names.values()}
    for event in events:
        if event["ph"] == "X":
            roles[names[event["pid"]]].append(event)
    return roles


def test_the_merged_trace_holds_the_chief_and_every_worker(captured):
    assert set(_spans_by_role(captured)) == {"chief", "worker:0", "worker:1"}


def test_every_worker_records_each_captured_step_in_its_parts(captured):
    for role, spans in _spans_by_role(captured).items():
        if role == "chief":
            continue
        for name in (INPUT_WAIT, FORWARD, BACKWARD, ALLREDUCE, APPLY, STEP):
            steps = sorted(e["args"]["step"] for e in spans if e["name"] == name)
            assert steps == list(range(FIRST, LAST)), (role, name)


def test_every_worker_records_one_span_per_bucket_with_its_bytes(captured):
    for role, spans in _spans_by_role(captured).items():
        if role == "chief":
            continue
        buckets = [e for e in spans if e["name"] == ALLREDUCE_BUCKET and e["args"]["step"] == FIRST]
        assert sorted(e["args"]["bucket"] for e in buckets) == list(range(NUM_BUCKETS)), role
        (whole,) = [e for e in spans if e["name"] == ALLREDUCE and e["args"]["step"] == FIRST]
        assert sum(e["args"]["bytes"] for e in buckets) == whole["args"]["bytes"]
        assert all(whole["ts"] <= e["ts"] and e["ts"] + e["dur"] <= whole["ts"] + whole["dur"] + 1 for e in buckets)


def test_profile_steps_splits_an_allreduce_workers_step_into_its_parts(captured, capsys):
    assert main(["profile", "steps", str(captured)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("worker:")}
    assert set(lines) == {"worker:0", "worker:1"}
    header = next(line for line in out.splitlines() if line.startswith("role"))
    for part in ("input_wait ms", "compute ms", "communication ms", "apply ms"):
        assert part in header
    # Each worker spent some of each step in the all-reduce and in the optimizer.
    for line in lines.values():
        communication, apply = line.split(")")[2:4]
        assert not communication.strip().startswith("0.000") and not apply.strip().startswith("0.000"), line
    assert "all-reduce" in out


def test_profile_top_and_report_read_an_allreduce_capture(captured, capsys):
    assert main(["profile", "top", str(captured)]) == 0
    assert ALLREDUCE_BUCKET in capsys.readouterr().out
    assert main(["profile", "report", str(captured)]) == 0
    assert list((captured / "profile").glob("*/report.html"))


def test_plan_calibrates_the_ring_on_the_allreduce_capture(captured):
    measured = calibrate(captured)
    assert (measured.strategy, measured.num_workers) == ("allreduce", 2)
    assert measured.model_bytes == ALLREDUCED_BYTES
    assert measured.ring is not None and measured.ring.bandwidth > 0
    assert 0 < measured.step_compute_s < measured.worker_step_s


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hybrid_capture_holds_the_workers_all_reduce_and_the_ps_applies(tmp_path, mode):
    """HybridStrategy: the PS record their spans at the workers' global step their pushes carry (in async mode a PS
    applies every worker's rows apart), so their parts join the capture: each worker's all-reduce and each PS's
    applies of the tables' rows, in the same window."""
    proc, _ = JobRun(tmp_path)(
        "tables.py", strategy="hybrid", mode=mode, num_batches=40, optimizer="Adagrad", profile_steps=[5, 10]
    )
    assert proc.returncode == 0, proc.stdout
    spans = _spans_by_role(tmp_path / "model")
    assert set(spans) == {"chief", "worker:0", "worker:1", "ps:0", "ps:1"}
    for worker in ("worker:0", "worker:1"):
        assert {e["args"]["step"] for e in spans[worker] if e["name"] == ALLREDUCE} == set(range(5, 10)), worker
    for ps in ("ps:0", "ps:1"):
        applies = [e["args"]["step"] for e in spans[ps] if e["name"] == APPLY]
        # sync: one update of both workers' rows a step; async: one of each worker's.
        assert sorted(applies) == sorted(list(range(5, 10)) * (1 if mode == "sync" else 2)), ps
