"""Failures on a real local cluster: a dead worker, a hung PS. The job ends with the role named, no orphans."""

from __future__ import annotations

import re
import signal
import time

import pytest


@pytest.mark.parametrize(
    ("victim", "max_restarts"),
    # Workers and PS are restarted while restarts are left (tests/integration/test_worker_loss.py); not here.
    [("worker:1", 0), ("ps:0", 0)],
)
def test_a_killed_role_that_is_not_restarted_fails_the_job_naming_it_and_leaves_no_orphans(
    start_job, tmp_path, victim, max_restarts
):
    log = tmp_path / "steps.jsonl"
    job = start_job(
        "regression.py",
        mode="async",
        num_workers=2,
        num_ps=1,
        max_steps=100_000,
        num_batches=100_000,
        step_delay_s=0.01,
        step_log=str(log),
        max_restarts=max_restarts,
    )
    job.wait_for_file(log)
    roles = job.roles()
    assert {"ps:0", "worker:0", "worker:1"} <= set(roles)
    roles[victim].send_signal(signal.SIGKILL)
    returncode, out = job.finish(timeout_s=30)
    assert returncode != 0
    assert victim in out and "SIGKILL" in out, out
    time.sleep(0.5)
    assert job.leftovers() == []


def test_hung_ps_fails_within_the_deadline_naming_the_peer_and_its_address(start_job, tmp_path):
    log = tmp_path / "steps.jsonl"
    job = start_job(
        "regression.py",
        mode="async",
        num_workers=1,
        num_ps=1,
        max_steps=100_000,
        num_batches=100_000,
        step_delay_s=0.01,
        step_log=str(log),
        request_timeout_s=2.0,
    )
    job.wait_for_file(log)
    roles = job.roles()
    roles["ps:0"].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    returncode, out = job.finish(timeout_s=30)
    assert returncode != 0
    # The worker's deadline fired (2 s), not some much later watchdog.
    assert time.monotonic() - stopped < 15
    # A local cluster's worker reaches its PS over the PS's UNIX socket.
    assert re.search(r"no reply from ps:0 at ipc://\S+/ps-0\b", out), out
    assert "worker:0" in out
    time.sleep(0.5)
    assert job.leftovers() == []


def test_training_over_encrypted_authenticated_connections(run_job, monkeypatch):
    # Loopback is not encrypted by default; "always" exercises the path every non-loopback address takes.
    monkeypatch.setenv("SHARDFLOW_ENCRYPT", "always")
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET", "integration-secret")
    proc, result = run_job("regression.py", mode="async", num_workers=2, num_ps=2, epochs=1, num_batches=40)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 40
    assert (
        "[ps:1] ps:1 serving at tcp://127.0.0.1:" in proc.stdout
        and "(authenticated and CURVE-encrypted)" in proc.stdout
    )
