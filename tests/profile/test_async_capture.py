"""One real async job (chief, a PS, two workers) pinned to one CPU core, captured twice while it runs: global steps
known ahead, with torch ops, and an on-demand capture (`shardflow profile capture`). The tests read the captures."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from shardflow.cli.main import main
from shardflow.profile.capture import capture_dir, finalize
from shardflow.profile.diagnose import diagnose
from shardflow.profile.events import load
from shardflow.profile.memory import CPU_CORES, RSS
from shardflow.profile.trace import check_legal, read_trace, write_trace

JOB = Path(__file__).parents[1] / "integration" / "jobs" / "regression.py"
# After the start: a worker may take its first step some 10 to 20 global steps after the other's, and a window
# that one worker misses has no arrows, ops or HTA rank of it.
FIRST, LAST = 100, 116
AHEAD = f"steps-{FIRST}-{LAST}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The job's MODEL_DIR once both captures are merged; the job is killed then, not run to its end."""
    tmp = tmp_path_factory.mktemp("async_capture")
    config = {
        "mode": "async",
        "num_ps": 1,
        "num_workers": 2,
        "epochs": 1,
        "num_batches": 1_000_000,
        "profile_steps": [FIRST, LAST],
        "profile_ops": True,
        "model_dir": str(tmp / "model"),
        "result": str(tmp / "result.json"),
    }
    (tmp / "config.json").write_text(json.dumps(config))
    # One core for all four processes: the run is oversubscribed on any machine.
    core = min(os.sched_getaffinity(0))
    job = subprocess.Popen(
        [sys.executable, str(JOB), str(tmp / "config.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    try:
        _wait_for(tmp / "model" / "profile" / AHEAD / "merged.trace.json.gz", job)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["profile", "capture", str(tmp / "model"), "--steps", "3"]) == 0
        (tmp / "profile_capture.txt").write_text(printed.getvalue())
        yield tmp / "model"
    finally:
        for process in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            process.kill()
        job.communicate()


def _wait_for(path: Path, job: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"{path} never appeared:\n{job.communicate()[0]}")
        time.sleep(0.1)


def merged(model_dir: Path, name: str) -> dict[str, Any]:
    with gzip.open(capture_dir(model_dir, name) / "merged.trace.json.gz") as file:
        trace: dict[str, Any] = json.load(file)
    return trace


def role_names(trace: dict[str, Any]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}


def on_demand_name(model_dir: Path) -> str:
    (directory,) = (model_dir / "profile").glob("on-demand-*")
    return directory.name


def test_profile_capture_says_what_it_asks_for_where_it_lands_and_which_roles_it_captured(model_dir):
    printed = (model_dir.parent / "profile_capture.txt").read_text()
    name = on_demand_name(model_dir)
    first, last = name.removeprefix("on-demand-").split("-")
    assert f"asked the job in {model_dir} for global steps [{first}, {last}) of every role" in printed
    assert f"waiting for the capture to land in {model_dir / 'profile' / name}" in printed
    assert f"captured chief, worker:0, worker:1, ps:0 into {model_dir / 'profile' / name}" in printed
    assert f"shardflow profile steps {model_dir} --capture {name}" in printed


def test_every_push_arrow_starts_before_the_apply_it_ends_in(model_dir):
    trace = merged(model_dir, AHEAD)
    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert starts and set(starts) == set(ends)
    assert [flow for flow in starts if ends[flow]["ts"] <= starts[flow]["ts"]] == []


def test_every_apply_of_the_window_shows_the_push_it_consumed_from_each_worker(model_dir):
    trace = merged(model_dir, AHEAD)
    names = role_names(trace)
    applies = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "apply"]
    arrows = [e for e in trace["traceEvents"] if e["ph"] == "f"]
    assert sorted(e["args"]["step"] for e in applies) == list(range(FIRST, LAST))
    assert len(arrows) == len(applies)
    starts = [e for e in trace["traceEvents"] if e["ph"] == "s"]
    assert {names[e["pid"]] for e in starts} == {"worker:0", "worker:1"}


def test_the_capture_with_pushes_from_before_its_window_is_structurally_legal(model_dir):
    assert check_legal(merged(model_dir, AHEAD)) == []


def test_op_level_events_lie_within_each_roles_window(model_dir):
    trace = merged(model_dir, AHEAD)
    names = role_names(trace)
    window: dict[int, tuple[float, float]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "span" and FIRST <= e["args"]["step"] < LAST:
            low, high = window.get(e["pid"], (e["ts"], e["ts"]))
            window[e["pid"]] = (min(low, e["ts"]), max(high, e["ts"] + e["dur"]))
    ops = [e for e in trace["traceEvents"] if e.get("cat") in ("op", "memory")]
    assert {names[e["pid"]] for e in ops if e.get("cat") == "op"} >= {"worker:0", "worker:1", "ps:0"}
    outside = [
        (names[e["pid"]], e["name"])
        for e in ops
        if not window[e["pid"]][0] <= e["ts"] and e["ts"] + e.get("dur", 0) <= window[e["pid"]][1]
    ]
    assert outside == []


def _stepping_roles(trace: dict[str, Any]) -> set[str]:
    """The workers and PS with a span of a global step of the capture's window: on one core shared by four
    processes, a worker may be starved through a short on-demand window. Then it shows only the pushes it sent
    before the window that the window's applies consumed; merge keeps them with their own, earlier, steps (and
    without a lead-in mark), and a role's counters cover only the time of its spans of the window."""
    names = role_names(trace)
    window = {role: range(info["first_step"], info["last_step"]) for role, info in trace["otherData"]["roles"].items()}
    spans = ((names[e["pid"]], e["args"]["step"]) for e in trace["traceEvents"] if e.get("cat") == "span")
    return {role for role, step in spans if role != "chief" and step in window[role]}


def test_an_on_demand_capture_has_memory_and_cpu_counters_for_every_role(model_dir):
    trace = merged(model_dir, on_demand_name(model_dir))
    names = role_names(trace)
    counters = {(names[e["pid"]], e["name"]) for e in trace["traceEvents"] if e["ph"] == "C"}
    # The chief has no span of a global step, so no window to cut counters for.
    stepping = _stepping_roles(trace)
    assert {"worker:0", "ps:0"} <= stepping or {"worker:1", "ps:0"} <= stepping, stepping
    for role in stepping:
        assert {(role, RSS), (role, CPU_CORES)} <= counters, role


def test_profile_memory_of_an_on_demand_capture_prints_each_roles_peak(model_dir, capsys):
    assert main(["profile", "memory", str(model_dir), "--capture", on_demand_name(model_dir)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    stepping = _stepping_roles(merged(model_dir, on_demand_name(model_dir)))
    assert {line[0] for line in lines if len(line) > 1 and line[1] == RSS} == stepping


def test_the_diagnosis_of_an_oversubscribed_run_blames_the_cores_not_the_number_of_workers(model_dir):
    findings = diagnose(load(finalize(capture_dir(model_dir, AHEAD))))
    messages = " ".join(finding.message for finding in findings)
    assert "add workers" not in messages
    assert "share 1 core and keep" in messages and "the cores, not the workers, are the limit" in messages


@pytest.mark.parametrize(
    ("query", "why"),
    [
        (["top", "--steps", "5000:5010"], "no event of global steps [5000, 5010) in the capture; it holds steps"),
        (["steps", "--steps", "5000:5010"], "no event of global steps [5000, 5010)"),
        (["top", "--filter", "^no such op$"], "--filter '^no such op$' matches no event name"),
        (["sql", "SELECT * FROM events WHERE name = 'no such span'"], "the query returned no rows"),
    ],
)
def test_a_query_that_selects_nothing_says_why_and_exits_1(model_dir, capsys, query, why):
    command, *options = query
    assert main(["profile", command, str(model_dir), "--capture", AHEAD, *options]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and f"shardflow profile {command}: nothing selected: {why}" in captured.err


def test_profile_memory_of_a_capture_without_counters_says_so_and_exits_1(model_dir, tmp_path, capsys):
    trace = read_trace(capture_dir(model_dir, AHEAD) / "merged.trace.json.gz")
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["ph"] != "C"]
    write_trace(trace, tmp_path / "model" / "profile" / "no-counters" / "merged.trace.json.gz")
    assert main(["profile", "memory", str(tmp_path / "model")]) == 1
    assert "nothing selected: the capture has no memory counters" in capsys.readouterr().err


def test_holistic_trace_analysis_breaks_down_each_ranks_time_from_the_export(model_dir, tmp_path, capsys):
    from hta.trace_analysis import TraceAnalysis

    assert main(["profile", "export", str(model_dir), "--capture", AHEAD, "--hta", str(tmp_path / "hta")]) == 0
    ranks = {role: info["rank"] for role, info in merged(model_dir, AHEAD)["otherData"]["roles"].items()}
    assert ranks == {"chief": 0, "worker:0": 1, "worker:1": 2, "ps:0": 3}
    # The chief does no work in a global step: no kernels, so no rank file (HTA cannot analyse an empty rank).
    assert "no work in the capture" in next(line for line in capsys.readouterr().out.splitlines() if "chief" in line)
    analysis = TraceAnalysis(trace_dir=str(tmp_path / "hta"))
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    assert sorted(temporal.index) == [1, 2, 3]
    parts = temporal["idle_time(us)"] + temporal["compute_time(us)"] + temporal["non_compute_time(us)"]
    assert (parts == temporal["kernel_time(us)"]).all() and (temporal["compute_time(us)"] > 0).all()
    assert (temporal.loc[[1, 2], "non_compute_time(us)"] > 0).all()  # the workers' pushes and pull waits
    idle, _ = analysis.get_idle_time_breakdown(ranks=[1, 2, 3], visualize=False)
    assert set(idle["rank"]) == {1, 2, 3} and (idle["idle_time"] >= 0).all()
