"""`shardflow profile capture` on a running sf.AllReduceStrategy job (a chief and two workers) and a running
sf.HybridStrategy job (its tables on two PS, sparse_mode="sync"): the chief merges the on-demand capture while the
job trains, and it holds each worker's steps of the window it asked for."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from shardflow.cli.main import main
from shardflow.profile.spans import ALLREDUCE, PUSH

JOBS = Path(__file__).parents[1] / "integration" / "jobs"
STEPS = 3
TRAINED_BATCHES = 120
"""The batches the workers compute before the test asks (some 60 global steps, 3 s at least): their progress
reports, once a second, told the chief more than the start."""


def _capture_while_running(tmp: Path, job: str, **config: Any) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """Start `job`, ask it for a capture of its next STEPS global steps once it trained a while, and kill it once
    the capture is merged. What `profile capture` printed, and the merged trace's complete spans by role."""
    model_dir, step_log = tmp / "model", tmp / "steps.log"
    config = {**config, "model_dir": str(model_dir), "result": str(tmp / "result.json"), "step_log": str(step_log)}
    (tmp / "config.json").write_text(json.dumps(config))
    process = subprocess.Popen(
        [sys.executable, str(JOBS / job), str(tmp / "config.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(lambda: step_log.exists() and step_log.read_text().count("\n") >= TRAINED_BATCHES, process)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["profile", "capture", str(model_dir), "--steps", str(STEPS)]) == 0
        assert process.poll() is None, "the capture was merged while the job trains"
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
        process.kill()
        process.communicate()
    (merged,) = (model_dir / "profile").glob("on-demand-*/merged.trace.json.gz")
    return printed.getvalue(), _spans_by_role(merged)


def _wait_for(trained: Callable[[], bool], process: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not trained():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the job did not train {TRAINED_BATCHES} batches:\n{process.communicate()[0]}")
        time.sleep(0.1)


def _spans_by_role(merged: Path) -> dict[str, list[dict[str, Any]]]:
    with gzip.open(merged) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    roles: dict[str, list[dict[str, Any]]] = {name: [] for name in names.values()}
    for event in events:
        if event["ph"] == "X":
            roles[names[event["pid"]]].append(event)
    return roles


def _window(printed: str) -> range:
    """The global steps `profile capture` said it asked for."""
    asked = printed.split("global steps [", 1)[1].split(")", 1)[0]
    first, last = (int(step) for step in asked.split(", "))
    assert last - first == STEPS
    return range(first, last)


@pytest.fixture(scope="module")
def allreduce(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("allreduce_capture")
    return _capture_while_running(tmp, "allreduce.py", num_workers=2, epochs=1, num_batches=100_000, step_delay_s=0.05)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("hybrid_capture")
    return _capture_while_running(
        tmp, "tables.py", strategy="hybrid", mode="sync", num_batches=100_000, batch=2, step_delay_s=0.05
    )


def test_an_on_demand_capture_of_an_allreduce_job_holds_the_chief_and_every_worker(allreduce):
    printed, spans = allreduce
    assert set(spans) == {"chief", "worker:0", "worker:1"}
    assert "captured chief, worker:0, worker:1 into" in printed


def test_an_on_demand_capture_of_an_allreduce_job_asks_for_steps_after_the_start(allreduce):
    printed, _ = allreduce
    assert _window(printed).start > 1, "the chief's global step follows the workers' progress"


def test_an_on_demand_capture_of_an_allreduce_job_holds_each_workers_allreduce_of_the_asked_steps(allreduce):
    printed, spans = allreduce
    window = _window(printed)
    for worker in ("worker:0", "worker:1"):
        steps = sorted(e["args"]["step"] for e in spans[worker] if e["name"] == ALLREDUCE)
        assert steps == list(window), worker


def test_an_on_demand_capture_of_a_hybrid_sync_job_holds_the_ps_too(hybrid):
    _, spans = hybrid
    assert set(spans) == {"chief", "worker:0", "worker:1", "ps:0", "ps:1"}


def test_an_on_demand_capture_of_a_hybrid_job_holds_each_workers_allreduce_and_pushes_of_the_asked_steps(hybrid):
    printed, spans = hybrid
    window = _window(printed)
    for worker in ("worker:0", "worker:1"):
        steps = sorted(e["args"]["step"] for e in spans[worker] if e["name"] == ALLREDUCE)
        assert steps == list(window), worker
        pushed = {e["args"]["step"] for e in spans[worker] if e["name"] == PUSH}
        assert pushed and pushed <= set(window), (worker, pushed)
