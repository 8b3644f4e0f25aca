"""Hung roles, stopped from outside (SIGSTOP: alive and silent): a PS, a chief (under `shardflow launch`) or a worker
stopped before it ever beat that never wakes is killed by the launcher and restarted, a PS that stalls past the data
plane's connection deadline and wakes has its requests sent again, and a worker that wakes after its shard went to
another stands down. Every job ends by itself, at its exact global step, with every record's gradient applied once
(tests/integration/jobs/audit.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from .test_worker_loss import JOBS, NUM_RECORDS, _audit, _kill_if_running, _role, _wait_for_training, _write_config

LONG = 8 * NUM_RECORDS
"""Records enough that training still runs when a role is stopped 1 s in."""


def _start(tmp_path: Path, **config: Any) -> subprocess.Popen[str]:
    path = _write_config(tmp_path, num_records=LONG, step_delay_s=0.01, **config)
    command = [sys.executable, str(JOBS / "audit.py"), str(path)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str], timeout_s: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        _kill_if_running(proc)
    return out


def test_a_ps_stopped_for_good_is_killed_and_restarted_and_the_job_ends_exact(tmp_path):
    proc = _start(
        tmp_path, save_checkpoints_steps=64, heartbeat_timeout_s=1.0, hung_timeout_s=3.0, restart_backoff_s=0.1
    )
    try:
        _wait_for_training(proc, tmp_path, 1.0)
        _role(proc, "ps:1").send_signal(signal.SIGSTOP)
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    assert "ps:1 is lost" in out and "is hung: no heartbeat for" in out and "restarting it" in out, out
    _audit(tmp_path, num_records=LONG)


def test_a_ps_stopped_past_the_connection_deadline_then_resumed_loses_no_request(tmp_path):
    # 10 s: the data plane drops the connection to a silent peer after 6 s.
    proc = _start(tmp_path, heartbeat_timeout_s=2.0)
    try:
        _wait_for_training(proc, tmp_path, 1.0)
        ps = _role(proc, "ps:1")
        ps.send_signal(signal.SIGSTOP)
        time.sleep(10.0)
        ps.send_signal(signal.SIGCONT)
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    assert "ps:1 rejoined" in out, out
    _audit(tmp_path, num_records=LONG)


def test_a_worker_that_wakes_after_its_shard_was_handed_over_stands_down(tmp_path):
    # Lost after 1 s, handed over 1 s later; the launcher has no restart to give it, so it never kills it.
    proc = _start(tmp_path, heartbeat_timeout_s=1.0, worker_rejoin_timeout_s=1.0, max_restarts=0)
    try:
        _wait_for_training(proc, tmp_path, 1.0)
        worker = _role(proc, "worker:1")
        worker.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not (tmp_path / "model" / "logs" / "chief.log").read_text().count("reads the rest of its shard"):
            assert time.monotonic() < deadline, "the shard was never handed over"
            time.sleep(0.1)
        worker.send_signal(signal.SIGCONT)
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    assert "worker:1 did not come back within worker_rejoin_timeout_s=1s: worker:0 reads the rest" in out, out
    assert "worker:1: worker:0 reads the rest of this worker's shard since it was lost; it stands down" in out, out
    _audit(tmp_path, num_records=LONG)


def test_a_chief_stopped_for_good_under_shardflow_launch_is_killed_and_restarted_and_the_job_ends_exact(tmp_path):
    path = _write_config(tmp_path, num_records=LONG, step_delay_s=0.01, save_checkpoints_steps=64)
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", "2", "--hung-timeout", "3"]
    command += ["--restart-backoff", "0.2", str(JOBS / "audit.py"), str(path)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_training(proc, tmp_path, 1.0)
        chief = _role(proc, "chief")
        chief.send_signal(signal.SIGSTOP)
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    assert f"chief (pid {chief.pid}) is hung: no heartbeat for" in out, out
    assert f"chief (pid {chief.pid}) exited with code -9 (SIGKILL); restarting it" in out, out
    assert "the chief was restarted: resumed from the live parameter servers at global step" in out, out
    # The stopped chief held up every role's heartbeat, never their liveness files: none else was taken for hung.
    assert out.count("is hung") == 1, out
    _audit(tmp_path, num_records=LONG, resumed=True)


class _Lines:
    """A job's output, read as it comes, so that a test can act the moment a line appears."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        with self._new:
            while True:
                for line in self.lines:
                    if found := re.search(pattern, line):
                        return found
                if not self._thread.is_alive() or not self._new.wait(deadline - time.monotonic()):
                    raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s:\n{self.text()}")

    def text(self) -> str:
        return "".join(self.lines)

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self._new.notify_all()


def test_a_worker_stopped_before_its_first_beat_is_killed_and_restarted(tmp_path):
    proc = _start(tmp_path, hung_timeout_s=3.0, restart_backoff_s=0.1)
    output = _Lines(proc)
    try:
        _wait_for_training(proc, tmp_path, 1.0)
        _role(proc, "worker:1").send_signal(signal.SIGKILL)
        # Stopped the moment the launcher started it again: before it could touch its liveness file, or just after.
        restarted = int(output.wait_for(r"restarted worker:1 \(pid (\d+)\)", timeout_s=30)[1])
        psutil.Process(restarted).send_signal(signal.SIGSTOP)
        proc.wait(timeout=120)
    finally:
        _kill_if_running(proc)
    out = output.text()
    assert proc.returncode == 0, out
    assert f"worker:1 (pid {restarted}) is hung: no heartbeat for" in out, out
    assert f"worker:1 (pid {restarted}) exited with code -9 (SIGKILL); restarting it" in out, out
    _audit(tmp_path, num_records=LONG)


def test_sync_a_worker_killed_while_its_step_waits_for_a_stopped_one_ends_exact(tmp_path):
    # Worker 0's step waits in the PS's sum for worker 1, stopped. Restarted, worker 0 must compute its next step on
    # that sum's update, not add a second batch of its own to it (one global step too many, a batch counted twice).
    proc = _start(tmp_path, mode="sync", heartbeat_timeout_s=30.0, restart_backoff_s=0.1)
    try:
        _wait_for_training(proc, tmp_path, 1.0)
        stopped = _role(proc, "worker:1")
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # worker 0's next push is summed and waits
        killed = _role(proc, "worker:0")
        killed.kill()
        killed.wait(10)
        log = tmp_path / "model" / "logs" / "worker_0.log"
        deadline = time.monotonic() + 60
        while "worker:0 rejoins the job" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None, "worker:0 never rejoined"
            time.sleep(0.1)
        time.sleep(1.0)
        stopped.send_signal(signal.SIGCONT)
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    _audit(tmp_path, num_records=LONG, replicas=2)
