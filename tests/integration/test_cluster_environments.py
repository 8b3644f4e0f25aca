"""The same job started the ways real clusters start it: TF_CONFIG per process (Kubeflow TFJob) and torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "jobs"


def _free_ports(count: int) -> list[int]:
    """`count` consecutive ports free now, below the kernel's range of ephemeral ports (32768 and up): a port it
    hands out for another test's bind to port 0, or for an outgoing connection, is never one of them. (A port bound
    to 0 and let go here was taken so once, under torchrun's MASTER_PORT + 1.)"""
    chooser = random.Random()
    for _ in range(100):
        base = chooser.randrange(20_000, 32_000)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return list(range(base, base + count))
    raise RuntimeError(f"no {count} consecutive free ports in 20000-32000")


def _torchrun(nproc: int, script: Path, config: Path) -> list[str]:
    """torchrun on one machine, its store on a free port whose next one is free too: the chief's control service
    listens on MASTER_PORT + 1 (cluster/spec.py)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    port, _ = _free_ports(2)
    rendezvous = ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return [str(torchrun), *rendezvous, "--nproc-per-node", str(nproc), str(script), str(config)]


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    config = {"mode": "async", "num_ps": 1, "epochs": 1, "num_batches": 60}
    path.write_text(json.dumps({**config, "model_dir": str(tmp_path / "model"), "result": str(tmp_path / "r.json")}))
    return path


def test_tf_config_in_each_process_runs_the_job(tmp_path):
    ports = _free_ports(4)
    cluster = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{ports[1]}"],
        "worker": [f"127.0.0.1:{ports[2]}", f"127.0.0.1:{ports[3]}"],
    }
    config = _config(tmp_path)
    procs = []
    try:
        for task_type, index in (("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)):
            env = {
                **os.environ,
                "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}}),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(JOBS / "regression.py"), str(config)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outputs
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["global_step"] == 60
    assert result["worker_steps"] == {"worker:0": 30, "worker:1": 30}
    # One machine without a launcher: the PS serves its peers on a private UNIX socket of its own as well (over TCP
    # every role would speak CURVE, at half the speed).
    assert "for this machine's roles" in outputs[1], outputs[1]


def test_torchrun_ranks_map_to_chief_ps_and_workers(tmp_path):
    config = _config(tmp_path)
    proc = subprocess.run(
        _torchrun(4, JOBS / "regression.py", config),
        env={**os.environ, "SHARDFLOW_NUM_PS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["global_step"] == 60
    assert set(result["worker_steps"]) == {"worker:0", "worker:1"}


@pytest.mark.parametrize(
    ("job", "nproc", "num_ps", "config"),
    [
        ("allreduce.py", 3, None, {"num_workers": 2, "max_steps": 10, "num_batches": 100}),
        ("tables.py", 5, "2", {"strategy": "hybrid", "mode": "async", "num_batches": 16, "max_steps": 6}),
    ],
    ids=["allreduce", "hybrid"],
)
def test_torchrun_ranks_map_to_the_roles_of_allreduce_and_hybrid_jobs(tmp_path, job, nproc, num_ps, config):
    """AllReduceStrategy: rank 0 the chief, the rest workers (no PS); HybridStrategy with SHARDFLOW_NUM_PS=2: the
    chief, 2 PS, then the workers. Both to their exact step."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "model_dir": str(tmp_path / "model"), "result": str(tmp_path / "r.json")}))
    proc = subprocess.run(
        _torchrun(nproc, JOBS / job, path),
        env={**os.environ, **({"SHARDFLOW_NUM_PS": num_ps} if num_ps else {})},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["global_step"] == config["max_steps"]
