"""The forward and backward spans of real PS and all-reduce workers carry the CPU time of the thread that ran them,
and it reaches the events table as its cpu_ns column."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from shardflow.profile.capture import capture_dir, finalize
from shardflow.profile.events import load
from shardflow.profile.spans import BACKWARD, FORWARD

JOBS = Path(__file__).parents[1] / "integration" / "jobs"
FIRST, LAST = 5, 15


def _run(job: str, tmp: Path, env: dict[str, str] | None = None, **config: object) -> pa.Table:
    """The events table of the capture of global steps [FIRST, LAST) of `job` run to its end with `config`."""
    config = {"model_dir": str(tmp / "model"), "result": str(tmp / "result.json"), **config}
    (tmp / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, str(JOBS / job), str(tmp / "config.json")],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return load(finalize(capture_dir(tmp / "model")))


def _compute_spans(table: pa.Table) -> list[dict[str, object]]:
    names = pc.is_in(table["name"], pa.array([FORWARD, BACKWARD]))
    return table.filter(pc.and_(pc.equal(table["ph"], "X"), names)).select(["dur", "cpu_ns"]).to_pylist()


@pytest.fixture(scope="module")
def ps_table(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    """One async PS worker's capture."""
    tmp = tmp_path_factory.mktemp("ps-cpu")
    return _run(
        "regression.py", tmp, mode="async", num_workers=1, epochs=1, num_batches=30, profile_steps=[FIRST, LAST]
    )


@pytest.fixture(scope="module")
def allreduce_table(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    """Two all-reduce workers' capture."""
    tmp = tmp_path_factory.mktemp("allreduce-cpu")
    env = {"SHARDFLOW_PROFILE_STEPS": f"{FIRST},{LAST}"}
    return _run("allreduce.py", tmp, env, num_workers=2, max_steps=LAST + 5, num_batches=100)


def _assert_each_carries_its_cpu_time(spans: list[dict[str, Any]]) -> None:
    assert len(spans) >= 2 * (LAST - FIRST)
    for span in spans:
        # The thread's CPU clock is read inside the span's wall-clock interval: it can only be shorter.
        assert 0 < span["cpu_ns"] <= span["dur"] * 1000 + 1, span


def test_a_ps_workers_forward_and_backward_carry_their_threads_cpu_time(ps_table):
    _assert_each_carries_its_cpu_time(_compute_spans(ps_table))


def test_an_allreduce_workers_forward_and_backward_carry_their_threads_cpu_time(allreduce_table):
    _assert_each_carries_its_cpu_time(_compute_spans(allreduce_table))


def test_no_other_span_has_a_cpu_time(ps_table):
    others = ps_table.filter(pc.invert(pc.is_in(ps_table["name"], pa.array([FORWARD, BACKWARD]))))
    assert others["cpu_ns"].null_count == len(others)
