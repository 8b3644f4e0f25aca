"""A real 5-process run (chief, 2 PS, 2 workers) captured by the profiler and merged into one trace."""

from __future__ import annotations

import gzip
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardflow.cluster.control_keys import capture_done, capture_part
from shardflow.cluster.control_plane import ControlPlane
from shardflow.profile import set_recorder
from shardflow.profile.spans import STEP
from shardflow.profile.trace import check_legal, read_trace
from shardflow.train.profiling import ChiefProfiler, RoleProfiler

FIRST, LAST = 10, 16
SKEW_US = 250_000.0


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> tuple[Path, dict]:
    """One profiled run shared by the tests below; worker:1's clock runs 250 ms ahead."""
    tmp = tmp_path_factory.mktemp("profiled")
    # Sync, so that both workers take part in every captured step whatever their start-up order.
    config = {
        "mode": "sync",
        "num_ps": 2,
        "num_workers": 2,
        "epochs": 1,
        "num_batches": 120,
        "profile_steps": [FIRST, LAST],
        "model_dir": str(tmp / "model"),
        "result": str(tmp / "result.json"),
        "clock_skew": {"role": "worker:1", "us": SKEW_US},
    }
    (tmp / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "jobs" / "skewed_clock.py"), str(tmp / "config.json")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp / "result.json").read_text())
    directory = Path(result["profile_dir"])
    with gzip.open(directory / "merged.trace.json.gz") as f:
        trace = json.load(f)
    return directory, trace


def _by_role(trace: dict) -> dict[str, list[dict]]:
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    roles: dict[str, list[dict]] = {name: [] for name in names.values()}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            roles[names[event["pid"]]].append(event)
    return roles


def test_every_role_has_events_for_exactly_the_captured_steps(capture):
    directory, trace = capture
    roles = _by_role(trace)
    assert set(roles) == {"chief", "worker:0", "worker:1", "ps:0", "ps:1"}
    for role in ("worker:0", "worker:1", "ps:0", "ps:1"):
        steps = {e["args"]["step"] for e in roles[role]}
        assert steps and min(steps) >= FIRST and max(steps) < LAST, (role, steps)
    # Every captured global step was applied on each PS, exactly once.
    for ps in ("ps:0", "ps:1"):
        applies = sorted(e["args"]["step"] for e in roles[ps] if e["name"] == "apply")
        assert applies == list(range(FIRST, LAST))
    # The roles' traces are merged in memory: the capture holds the merged trace and its table only.
    assert sorted(p.name for p in directory.glob("*.trace.json.gz")) == ["merged.trace.json.gz"]
    assert (directory / "events.parquet").exists()


def test_flows_connect_each_push_to_the_apply_that_consumed_it(capture):
    _, trace = capture
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]

    def enclosing(event: dict) -> str:
        """The span the flow event binds to: the innermost span on its thread that contains it."""
        around = [
            s
            for s in spans
            if s["pid"] == event["pid"] and s["tid"] == event["tid"] and s["ts"] <= event["ts"] <= s["ts"] + s["dur"]
        ]
        return min(around, key=lambda s: s["dur"])["name"] if around else "none"

    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    # Arrows whose push or apply fell outside the window are dropped; the rest pair up.
    assert starts and set(starts) == set(ends)
    for flow, start in starts.items():
        assert names[start["pid"]].startswith("worker:") and enclosing(start) == "push"
        end = ends[flow]
        assert names[end["pid"]].startswith("ps:") and enclosing(end) == "apply"
    assert {names[e["pid"]] for e in ends.values()} == {"ps:0", "ps:1"}


def test_clock_offsets_lie_within_their_bounds_even_with_an_injected_skew(capture):
    _, trace = capture
    roles = trace["otherData"]["roles"]
    for role, meta in roles.items():
        true_offset = -SKEW_US if role == "worker:1" else 0.0
        assert abs(meta["clock_offset_us"] - true_offset) <= meta["clock_error_us"] + 1.0, (role, meta)
        assert meta["clock_error_us"] < 10_000


def test_the_merged_trace_is_structurally_legal(capture):
    _, trace = capture
    assert check_legal(trace) == []
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            assert isinstance(event["ts"], (int, float)) and isinstance(event["dur"], (int, float))


def test_on_demand_capture_of_a_running_job(start_job, tmp_path):
    job = start_job(
        "regression.py", mode="async", num_workers=2, num_ps=1, epochs=1, num_batches=4000, step_delay_s=0.005
    )
    job.wait_for_file(tmp_path / "model" / "job.json")
    proc = subprocess.run(
        [sys.executable, "-m", "shardflow", "profile", "capture", str(tmp_path / "model"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Merged while the job goes on, not at its end.
    assert job.proc.poll() is None
    found = re.search(r"^captured .* into (\S+); to read it:$", proc.stdout, re.MULTILINE)
    assert found is not None, proc.stdout
    directory = Path(found[1])
    with gzip.open(directory / "merged.trace.json.gz") as f:
        trace = json.load(f)
    first, last = (int(x) for x in directory.name.split("-")[-2:])
    assert last - first == 3
    applies = sorted(e["args"]["step"] for e in trace["traceEvents"] if e.get("name") == "apply")
    assert applies == [first, first + 1, first + 2]
    assert check_legal(trace) == []
    returncode, out = job.finish(timeout_s=120)
    assert returncode == 0, out


def test_op_level_detail_is_folded_into_the_capture(run_job):
    proc, result = run_job(
        "regression.py",
        mode="sync",
        num_ps=1,
        num_workers=2,
        epochs=1,
        num_batches=60,
        profile_steps=[10, 12],
        profile_ops=True,
    )
    assert proc.returncode == 0, proc.stdout
    from shardflow.profile.capture import finalize
    from shardflow.profile.events import load

    table = load(finalize(result["profile_dir"])).to_pylist()
    ops = [row for row in table if row["cat"] == "op"]
    assert any(row["name"].startswith("aten::") and row["role"].startswith("worker:") for row in ops)
    # Python source attribution reaches the user's own loss function.
    assert any(row["source"] and "regression.py" in row["source"] for row in ops)
    assert any(row["shape"] for row in ops)
    # Allocations with the op and shape that made them.
    assert any(row["cat"] == "memory" and row["op"] and row["bytes"] for row in table)


def test_the_chief_merges_its_own_part_from_memory_and_the_others_from_the_control_plane(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    chief_control = ControlPlane.serve(f"127.0.0.1:{port}", timeout_s=10.0)
    chief = ChiefProfiler(chief_control, "127.0.0.1", tmp_path)
    try:
        worker = RoleProfiler("worker:0", ControlPlane(f"127.0.0.1:{port}", timeout_s=10.0))
        name = chief.request(0, 2).name
        worker.check_requests()
        for step in range(3):
            for profiler in (chief, worker):
                with profiler.recorder.span(STEP, step):
                    pass
                profiler.at_step(step)
        (directory,) = chief.collect(["chief", "worker:0"], timeout_s=10.0, final=True)
    finally:
        chief.close()
        set_recorder(None)
    assert chief_control.is_set(capture_part(name, "worker:0"))
    assert not chief_control.is_set(capture_part(name, "chief"))
    assert chief_control.get(capture_done(name), waiting_for="the merge") == str(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["capture.json", "events.parquet", "merged.trace.json.gz"]
    trace = read_trace(directory / "merged.trace.json.gz")
    assert set(trace["otherData"]["roles"]) == {"chief", "worker:0"}
    steps = sorted(e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == STEP)
    assert steps == [0, 0, 1, 1]
