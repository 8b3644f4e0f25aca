"""sf.AllReduceStrategy started the way a cluster manager starts a job: a process per role, each with its own
TF_CONFIG (a chief and workers, no PS), and no launcher watching them; and sf.HybridStrategy so (with PS)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from .conftest import TFConfigJob


def _start(tmp_path: Path, **config) -> TFConfigJob:
    config_path = tmp_path / "config.json"
    config.setdefault("model_dir", str(tmp_path / "model"))
    config.setdefault("result", str(tmp_path / "result.json"))
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "SHARDFLOW_CLUSTER_SECRET": "allreduce-tf-config"}
    return TFConfigJob("allreduce.py", config_path, env, num_ps=0, num_workers=2)


def test_a_tf_config_cluster_of_a_chief_and_two_workers_trains_to_an_exact_step(tmp_path):
    roles = _start(tmp_path, num_workers=2, max_steps=12, num_batches=100)
    outputs = roles.finish(timeout_s=150)
    assert [p.returncode for p in roles.procs.values()] == [0, 0, 0], roles.describe(outputs)
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == 12


def test_a_worker_killed_without_a_launcher_and_not_restarted_fails_the_job_naming_it(tmp_path):
    roles = _start(
        tmp_path,
        num_workers=2,
        epochs=1,
        num_batches=2000,
        step_delay_s=0.05,
        step_log=str(tmp_path / "s"),
        worker_rejoin_timeout_s=3,
    )
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "s").exists() or len((tmp_path / "s").read_text().splitlines()) < 6:  # training
            running = roles.procs["chief", 0].poll() is None and time.monotonic() < deadline
            assert running, roles.describe(roles.finish(5))
            time.sleep(0.1)
        roles.procs["worker", 1].send_signal(signal.SIGKILL)
        chief = roles.procs["chief", 0].communicate(timeout=120)[0]
    finally:
        roles.kill()
    assert roles.procs["chief", 0].returncode != 0, chief
    assert "RoleFailedError: worker:0 failed: GroupLostError" in chief, chief
    assert "worker:1 did not join generation 1 of the all-reduce group within worker_rejoin_timeout_s=3s" in chief


def test_a_tf_config_cluster_of_hybrid_roles_trains_its_tables_on_the_ps(tmp_path):
    """HybridStrategy with a process per role (a chief, 2 PS, 2 workers), each with its TF_CONFIG: the sf.nn tables
    on the PS, the head all-reduced, to an exact step."""
    config_path = tmp_path / "config.json"
    config = {"strategy": "hybrid", "mode": "async", "num_batches": 16, "max_steps": 6, "optimizer": "Adagrad"}
    config.update(model_dir=str(tmp_path / "model"), result=str(tmp_path / "result.json"))
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "SHARDFLOW_CLUSTER_SECRET": "hybrid-tf-config"}
    roles = TFConfigJob("tables.py", config_path, env, num_ps=2, num_workers=2)
    outputs = roles.finish(timeout_s=150)
    assert all(p.returncode == 0 for p in roles.procs.values()), roles.describe(outputs)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == 6 and set(result["ps_stats"]) == {"ps:0", "ps:1"}, result
