"""Real local jobs whose input_fn forgets to shard, or yields nothing: each worker auto-shards its input and says
how, and an empty input fails the job naming the worker instead of training nothing, or hanging, in silence."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from shardflow.data import TFRecordWriter

NUM_RECORDS, BATCH = 96, 8


def write_records(directory: Path, num_files: int = 4) -> str:
    """`num_files` TFRecord files of int64 ids, NUM_RECORDS in all; returns their glob."""
    directory.mkdir()
    per_file = NUM_RECORDS // num_files
    for f in range(num_files):
        writer = TFRecordWriter(str(directory / f"train-{f}.tfrecord"))
        for record in range(f * per_file, (f + 1) * per_file):
            writer.write(np.int64(record).tobytes())
        writer.close()
    return str(directory / "train-*.tfrecord")


@pytest.mark.parametrize(("source", "policy"), [("files", "FILE"), ("tensors", "DATA")])
def test_forgetting_shard_with_two_workers_trains_each_record_once(run_job, tmp_path, source, policy):
    proc, result = run_job("unsharded.py", source=source, pattern=write_records(tmp_path / "data"), epochs=1)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == NUM_RECORDS // BATCH
    assert result["seen"] == [1.0] * NUM_RECORDS
    for worker in ("worker:0", "worker:1"):
        assert f"[{worker}] {worker} " in proc.stdout and f"(AutoShardPolicy.{policy}" in proc.stdout, proc.stdout


def test_policy_off_has_every_worker_read_everything_and_say_so(run_job, tmp_path):
    proc, result = run_job("unsharded.py", source="tensors", policy="OFF", epochs=1)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 2 * NUM_RECORDS // BATCH
    assert result["seen"] == [2.0] * NUM_RECORDS
    for worker in ("worker:0", "worker:1"):
        line = f"[{worker}] {worker} reads the whole input, as each of the 2 workers does (AutoShardPolicy.OFF"
        assert line in proc.stdout, proc.stdout


@pytest.mark.parametrize("length", [{"epochs": 2}, {"max_steps": 40}])
def test_an_input_that_yields_nothing_fails_the_job_naming_the_worker(run_job, tmp_path, length):
    pattern = str(tmp_path / "no-such-dir" / "*.tfrecord")
    proc, _ = run_job("unsharded.py", source="glob", pattern=pattern, timeout_s=90, **length)
    assert proc.returncode != 0, proc.stdout
    # Whichever worker finds it first fails the job; neither is restarted (it would find the same).
    assert re.search(r"worker:[01] read no batch in its first epoch", proc.stdout), proc.stdout
    assert "Likely a glob that matches no file" in proc.stdout, proc.stdout
    assert "restarting it" not in proc.stdout, proc.stdout


def test_an_allowed_empty_input_with_max_steps_ends_and_says_why(run_job, tmp_path):
    pattern = str(tmp_path / "no-such-dir" / "*.tfrecord")
    proc, result = run_job(
        "unsharded.py", source="glob", pattern=pattern, max_steps=40, allow_empty_input=True, timeout_s=90
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 0
    assert "worker:1 has no input (TrainSpec.allow_empty_input=True): it trains no step" in proc.stdout
    assert "training ended at global step 0, before max_steps=40: the input of every worker ended" in proc.stdout
