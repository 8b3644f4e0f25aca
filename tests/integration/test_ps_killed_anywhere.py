"""A PS SIGKILLed from outside at a moment nobody chose: the launcher restarts it, the chief restores every PS from
the latest checkpoint, the workers wait for that restore and rejoin (with their shared-memory lanes attached to the
new process), and the job ends by itself at its exact global step with every record applied exactly once.

Each job is tests/integration/jobs/audit.py. The moment is drawn from a seeded generator and printed, so a failure
can be run again: SHARDFLOW_KILL_SEED=<seed> picks it. The suite runs four of the eight cases (each PS, each mode and
each lane setting twice, every pair of them once) and the second-PS case in async, to stay within its time;
SHARDFLOW_KILL_RUNS=<n> runs all of them n times (`python benchmarks/faults.py --runs 5 --only "from outside"` too)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from shardflow import env
from shardflow.cluster.zygote import role_of

from .test_worker_loss import JOBS, NUM_RECORDS, _audit, _kill_if_running, _wait_for_training, _write_config

RUNS = int(os.environ.get("SHARDFLOW_KILL_RUNS", "1"))
EVERY_CASE = "SHARDFLOW_KILL_RUNS" in os.environ
CASES = [
    (ps, mode, lanes)
    for ps in ("ps:0", "ps:1")
    for mode in ("async", "sync")
    for lanes in (True, False)
    # Four that hold every pair of values: (ps:0, async, lanes), (ps:0, sync, sockets), (ps:1, async, sockets)...
    if EVERY_CASE or lanes == ((ps == "ps:0") == (mode == "async"))
]
# 2048 records of 8 over 2 workers, steps of at least 15 ms: about 3 s of training, checkpoints every 16 steps.
NUM_KILL_RECORDS = 2 * NUM_RECORDS
PACE = {"num_records": NUM_KILL_RECORDS, "step_delay_s": 0.015, "save_checkpoints_steps": 16}
RESTORED = "was lost and restarted: every PS restored"


def _seed(case: str, run: int) -> int:
    given = os.environ.get("SHARDFLOW_KILL_SEED")
    return int(given) if given is not None else random.Random(f"{case}/{run}").randrange(2**31)


class _Job:
    """The audit job, embedded (its roles are its children), with its output collected as it comes."""

    def __init__(self, tmp_path: Path, mode: str, lanes: bool, **config: Any) -> None:
        self.tmp_path, self.mode = tmp_path, mode
        path = _write_config(tmp_path, mode=mode, **PACE, **config)
        job_env = {**os.environ, env.SHARED_MEMORY: "on" if lanes else "off"}
        command = [sys.executable, str(JOBS / "audit.py"), str(path)]
        self.proc = subprocess.Popen(command, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def kill(self, name: str) -> int:
        """SIGKILL role `name` from outside, as an operator or the kernel would; its pid."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if role_of(child) == name:
                        os.kill(child.pid, signal.SIGKILL)
                        return child.pid
                except (psutil.Error, ProcessLookupError):
                    continue
            time.sleep(0.02)  # between two runs of it: the launcher restarts it after its back-off
        pytest.fail(f"no process of {name} under the job:\n{self.output()}")

    def wait_for(self, text: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"no {text!r}:\n{self.output()}"
            time.sleep(0.01)

    def output(self) -> str:
        return "".join(self.lines)

    def finish(self, what: str) -> str:
        """The job's output, once it ended by itself at its exact step with every record applied once."""
        try:
            self.proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what}: the job did not end within 150s:\n{self.output()}")
        finally:
            _kill_if_running(self.proc)
        self._reader.join(timeout=10)
        out = self.output()
        assert self.proc.returncode == 0, f"{what}\n{out}"
        assert "SIGKILL" in out and "restarting it" in out and RESTORED in out, f"{what}\n{out}"
        _audit(self.tmp_path, num_records=NUM_KILL_RECORDS, replicas=2 if self.mode == "sync" else 1)
        return out

    def stop(self) -> None:
        _kill_if_running(self.proc)


@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize(
    ("ps", "mode", "lanes"), CASES, ids=[f"{p}-{m}-{'lanes' if x else 'sockets'}" for p, m, x in CASES]
)
def test_a_ps_killed_from_outside_at_a_random_moment_is_restored_and_the_job_ends_exact(tmp_path, ps, mode, lanes, run):
    case = f"{ps} {mode} {'lanes' if lanes else 'sockets'}"
    seed = _seed(case, run)
    after_s = random.Random(seed).uniform(0.2, 2.0)
    what = f"{case}: SIGKILL {after_s:.2f}s into training (SHARDFLOW_KILL_SEED={seed})"
    print(what)
    job = _Job(tmp_path, mode, lanes)
    try:
        _wait_for_training(job.proc, tmp_path, after_s)
        job.kill(ps)
    except BaseException:
        job.stop()
        raise
    job.finish(what)


@pytest.mark.parametrize("mode", ["async", "sync"] if EVERY_CASE else ["async"])
def test_a_second_ps_killed_while_the_first_is_restored_converges(tmp_path, mode):
    seed = _seed(f"two {mode}", 0)
    after_s = random.Random(seed).uniform(0.3, 1.5)
    what = f"{mode}: ps:1 killed {after_s:.2f}s into training, ps:0 as the chief restores (SHARDFLOW_KILL_SEED={seed})"
    print(what)
    job = _Job(tmp_path, mode, True)
    try:
        _wait_for_training(job.proc, tmp_path, after_s)
        job.kill("ps:1")
        job.wait_for("ps:1 was restarted")  # the chief saw it beat again: it restores every PS now
        job.kill("ps:0")
    except BaseException:
        job.stop()
        raise
    out = job.finish(what)
    assert "ps:0 was restarted" in out, f"{what}\n{out}"
    print("".join(line for line in job.lines if "restor" in line))


def test_a_worker_and_a_ps_killed_in_a_job_with_a_dynamic_table_end_exact(tmp_path):
    """The audit job's sf.nn.DynamicEmbedding counts every record too: after a worker and a PS are SIGKILLed, its
    rows (made on the PS as records arrive, restored from the checkpoint files) say each record was applied once."""
    job = _Job(tmp_path, "async", True, dynamic=True)
    try:
        _wait_for_training(job.proc, tmp_path, 0.5)
        job.kill("worker:1")
        _wait_for_training(job.proc, tmp_path, 0.5)
        job.kill("ps:1")
    except BaseException:
        job.stop()
        raise
    job.finish("worker:1 then ps:1 killed, with a dynamic table")
