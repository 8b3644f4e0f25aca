"""A worker that never comes back: with `epochs=k` in async mode its remaining shard goes to another worker, which
reads it as that worker once its own is done, and every record is still applied exactly once; otherwise (sync) the
job fails naming it. Under TF_CONFIG, with no supervisor to restart the worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from .test_cluster_environments import _free_ports

JOBS = Path(__file__).parent / "jobs"
NUM_RECORDS, BATCH = 1024, 8


def _start_job(tmp_path: Path, mode: str) -> dict[tuple[str, int], subprocess.Popen[str]]:
    ports = _free_ports(5)
    cluster = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"],
        "worker": [f"127.0.0.1:{ports[3]}", f"127.0.0.1:{ports[4]}"],
    }
    config = tmp_path / "config.json"
    job = {"model_dir": str(tmp_path / "model"), "result": str(tmp_path / "result.json"), "mode": mode}
    config.write_text(json.dumps({**job, "heartbeat_timeout_s": 2.0, "worker_rejoin_timeout_s": 3.0}))
    fault = {"role": "worker:1", "point": "push", "step": 20, "marker": str(tmp_path / "fault.fired")}
    env = {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault), "SHARDFLOW_CLUSTER_SECRET": "handover"}

    def start(task_type: str, index: int) -> subprocess.Popen[str]:
        task_env = {**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}
        command = [sys.executable, str(JOBS / "audit.py"), str(config)]
        return subprocess.Popen(command, env=task_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    return {name: start(*name) for name in (("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1))}


def _finish(procs: dict[tuple[str, int], subprocess.Popen[str]]) -> dict[tuple[str, int], str]:
    try:
        return {name: p.communicate(timeout=150)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()


def test_async_a_worker_lost_for_good_hands_its_shard_over_and_every_record_is_applied_once(tmp_path):
    procs = _start_job(tmp_path, "async")
    outputs = _finish(procs)
    codes = {name: p.returncode for name, p in procs.items()}
    described = "\n".join(f"--- {name} exited {codes[name]}:\n{out[-3000:]}" for name, out in outputs.items())
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
    procs = _start_job(tmp_path, "sync")
    outputs = _finish(procs)
    assert procs["chief", 0].returncode != 0, outputs["chief", 0]
    assert "worker:1 was lost" in outputs["chief", 0] and "worker_rejoin_timeout_s=3s" in outputs["chief", 0]
