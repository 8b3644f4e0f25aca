"""A worker that never comes back: with `epochs=k` in async mode its remaining shard goes to another worker, which
reads it as that worker once its own is done, and every record is still applied exactly once; otherwise (sync) the
job fails naming it. Under TF_CONFIG, with no supervisor to restart the worker."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import TFConfigJob

NUM_RECORDS, BATCH = 1024, 8


def _run_job(tmp_path: Path, mode: str, step: int = 20) -> tuple[TFConfigJob, dict[tuple[str, int], str]]:
    config = tmp_path / "config.json"
    job = {"model_dir": str(tmp_path / "model"), "result": str(tmp_path / "result.json"), "mode": mode}
    config.write_text(json.dumps({**job, "heartbeat_timeout_s": 2.0, "worker_rejoin_timeout_s": 3.0}))
    fault = {"role": "worker:1", "point": "push", "step": step, "marker": str(tmp_path / "fault.fired")}
    env = {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault), "SHARDFLOW_CLUSTER_SECRET": "handover"}
    roles = TFConfigJob("audit.py", config, env)
    return roles, roles.finish()


# Killed between its pushes to the two PS: at step 20, or at its last step (64 of 64), where nothing of its shard is
# left to read and the taker only finishes the step ps:1 lacks, which the job's end waits for.
@pytest.mark.parametrize("step", [20, NUM_RECORDS // BATCH // 2])
def test_async_a_worker_lost_for_good_hands_its_shard_over_and_every_record_is_applied_once(tmp_path, step):
    roles, outputs = _run_job(tmp_path, "async", step)
    codes = {name: p.returncode for name, p in roles.procs.items()}
    described = roles.describe(outputs)
    assert codes.pop(("worker", 1)) == -signal.SIGKILL, described
    assert set(codes.values()) == {0}, described
    chief = outputs["chief", 0]
    assert "worker:1 did not come back within worker_rejoin_timeout_s=3s: worker:0 reads the rest" in chief, described
    assert "worker:0 reads the rest of worker:1's shard" in outputs["worker", 0], described
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == NUM_RECORDS // BATCH
    applied = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))["seen"]
    counts = torch.bincount(applied.round().long(), minlength=3)
    assert torch.equal(applied, torch.ones_like(applied)), f"records applied 0, 1, 2.. times: {counts.tolist()}"


def test_sync_a_worker_lost_for_good_fails_the_job_naming_it(tmp_path):
    roles, outputs = _run_job(tmp_path, "sync")
    assert roles.procs["chief", 0].returncode != 0, outputs["chief", 0]
    assert "worker:1 was lost" in outputs["chief", 0] and "worker_rejoin_timeout_s=3s" in outputs["chief", 0]
