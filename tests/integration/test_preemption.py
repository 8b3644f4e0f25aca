"""Preemption on a real local cluster: SIGTERM to the job, to one worker or to `shardflow launch` checkpoints at the
current exact step, every process exits within the grace period, and the next run resumes with every batch
applied exactly once."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from shardflow.cluster.launcher import PREEMPTED_EXIT_CODE
from shardflow.cluster.zygote import role_of

JOBS = Path(__file__).parent / "jobs"
GRACE_S = 10.0
NUM_BATCHES = 240
# One epoch of NUM_BATCHES batches, read in worker shards; async: every applied batch is one global step.
JOB = {
    "mode": "async",
    "num_workers": 2,
    "num_ps": 1,
    "epochs": 1,
    "num_batches": NUM_BATCHES,
    "step_delay_s": 0.02,
    "termination_grace_s": GRACE_S,
}


def wait_for_steps(log: Path, proc: subprocess.Popen[str], num_steps: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not log.exists() or len(log.read_text().splitlines()) < num_steps:
        assert proc.poll() is None, "the job ended before it was preempted"
        assert time.monotonic() < deadline, f"fewer than {num_steps} steps after {timeout_s}s"
        time.sleep(0.05)


def wait_for_exit(proc: subprocess.Popen[str], processes: list[psutil.Process], sent: float) -> tuple[int, float]:
    """The job's exit status and the seconds from `sent` until it and every one of `processes` were gone."""
    try:
        returncode = proc.wait(timeout=GRACE_S + 5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job was still running {GRACE_S + 5}s after SIGTERM")
    alive = processes
    while alive and time.monotonic() - sent < GRACE_S + 5:
        alive = [p for p in processes if _alive(p)]
        time.sleep(0.02)
    assert not alive, f"still running after SIGTERM: {alive}"
    return returncode, time.monotonic() - sent


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def manifest_step(model_dir: Path) -> int:
    manifests = sorted((model_dir / "checkpoints").glob("*/manifest.json"))
    steps = [int(json.loads(path.read_text())["global_step"]) for path in manifests]
    return max(steps)


def assert_checkpointed_where_training_stopped(model_dir: Path, first: dict[str, Any]) -> int:
    """The global step the preempted run ended at, which its last checkpoint holds."""
    assert first["preempted"] is True
    stopped_at = int(first["global_step"])
    assert 0 < stopped_at < NUM_BATCHES
    assert manifest_step(model_dir) == stopped_at
    return stopped_at


def assert_resumed_exactly(second: dict[str, Any], stopped_at: int) -> None:
    assert second["start_step"] == stopped_at
    # Every batch of the epoch applied exactly once over both runs: none lost with the preemption, none repeated.
    assert second["global_step"] == NUM_BATCHES
    assert second["preempted"] is False


def rerun(run_job: Any, tmp_path: Path, stopped_at: int) -> None:
    proc, second = run_job("regression.py", timeout_s=60, **JOB, step_log=str(tmp_path / "steps-2.jsonl"))
    assert proc.returncode == 0, proc.stdout
    assert_resumed_exactly(second, stopped_at)


@pytest.fixture
def tracked():
    """Processes SIGKILLed at teardown, even when the test failed."""
    processes: list[psutil.Process] = []
    yield processes
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


def test_sigterm_to_the_embedded_launcher_checkpoints_at_the_current_step_and_resumes_exactly(
    start_job, run_job, tmp_path
):
    log = tmp_path / "steps.jsonl"
    job = start_job("regression.py", **JOB, step_log=str(log))
    wait_for_steps(log, job.proc, 30)
    roles = list(job.roles().values())
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    returncode, took_s = wait_for_exit(job.proc, roles, sent)
    out = job.finish(5)[1]
    assert returncode == PREEMPTED_EXIT_CODE, out
    assert took_s < GRACE_S, out
    print(f"SIGTERM to the embedded launcher: every process gone after {took_s:.2f}s")
    first = json.loads((tmp_path / "result.json").read_text())
    chief_log = (tmp_path / "model" / "logs" / "chief.log").read_text()
    assert f"preempted: checkpoint {first['checkpoint']} at global step {first['global_step']}" in chief_log
    rerun(run_job, tmp_path, assert_checkpointed_where_training_stopped(tmp_path / "model", first))


def test_ctrl_c_on_python_train_py_checkpoints_like_sigterm_with_one_line_per_process(start_job, run_job, tmp_path):
    log = tmp_path / "steps.jsonl"
    job = start_job("regression.py", **JOB, step_log=str(log))
    wait_for_steps(log, job.proc, 30)
    roles = list(job.roles().values())
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGINT)  # what the terminal sends the process the user started
    returncode, _ = wait_for_exit(job.proc, roles, sent)
    out = job.finish(5)[1]
    assert returncode == PREEMPTED_EXIT_CODE, out
    assert "Ctrl-C: checkpointing and ending the job" in out, out
    assert "Traceback" not in out and "SIGTERM after the job ended" not in out, out
    first = json.loads((tmp_path / "result.json").read_text())
    rerun(run_job, tmp_path, assert_checkpointed_where_training_stopped(tmp_path / "model", first))


def test_sigterm_to_one_worker_preempts_the_whole_job_and_resumes_exactly(start_job, run_job, tmp_path):
    log = tmp_path / "steps.jsonl"
    job = start_job("regression.py", **JOB, step_log=str(log))
    wait_for_steps(log, job.proc, 30)
    roles = job.roles()
    sent = time.monotonic()
    roles["worker:1"].send_signal(signal.SIGTERM)
    returncode, took_s = wait_for_exit(job.proc, list(roles.values()), sent)
    out = job.finish(5)[1]
    assert returncode == PREEMPTED_EXIT_CODE, out
    assert took_s < GRACE_S, out
    print(f"SIGTERM to worker:1: every process gone after {took_s:.2f}s")
    assert "preempted by SIGTERM to worker:1" in (tmp_path / "model" / "logs" / "chief.log").read_text()
    first = json.loads((tmp_path / "result.json").read_text())
    rerun(run_job, tmp_path, assert_checkpointed_where_training_stopped(tmp_path / "model", first))


def test_sigterm_to_shardflow_launch_preempts_the_job_and_the_next_launch_resumes_exactly(tmp_path, tracked):
    model_dir, result = tmp_path / "model", tmp_path / "result.json"
    log = tmp_path / "steps.jsonl"

    def launch(step_log: Path) -> subprocess.Popen[str]:
        config = tmp_path / "config.json"
        config.write_text(
            json.dumps({**JOB, "model_dir": str(model_dir), "result": str(result), "step_log": str(step_log)})
        )
        command = [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", "1"]
        command += ["--termination-grace", str(GRACE_S), str(JOBS / "regression.py"), str(config)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tracked.append(psutil.Process(proc.pid))
        return proc

    launcher = launch(log)
    wait_for_steps(log, launcher, 30)
    roles = [process for process in psutil.Process(launcher.pid).children(recursive=True) if role_of(process)]
    tracked.extend(roles)
    assert len(roles) == 4
    sent = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    returncode, took_s = wait_for_exit(launcher, roles, sent)
    out = launcher.communicate()[0]
    assert returncode == PREEMPTED_EXIT_CODE, out
    assert took_s < GRACE_S, out
    print(f"SIGTERM to shardflow launch: every process gone after {took_s:.2f}s")
    stopped_at = assert_checkpointed_where_training_stopped(model_dir, json.loads(result.read_text()))

    again = launch(tmp_path / "steps-2.jsonl")
    out = again.communicate(timeout=60)[0]
    assert again.returncode == 0, out
    assert_resumed_exactly(json.loads(result.read_text()), stopped_at)


TABLES_STEPS, TABLES_BATCH = 400, 4
TABLES_JOB = {
    "mode": "async",
    "audit": True,
    "optimizer": "SGD",
    "lr": 0.05,
    "num_workers": 2,
    "num_ps": 2,
    "num_batches": TABLES_STEPS,
    "batch": TABLES_BATCH,
}


def _applied_per_record(model_dir: Path) -> Any:
    """How many times each record was applied over both runs: the audit table's rows (jobs/tables.py)."""
    import torch

    from shardflow.train.checkpoints import store
    from shardflow.train.checkpoints.table_rows import CheckpointRows

    latest = store.latest(model_dir)
    assert latest is not None, f"no checkpoint in {model_dir}"
    rows = CheckpointRows(latest, "audit", lambda ids: torch.zeros(ids.numel(), 1))
    return rows.lookup(torch.arange(TABLES_STEPS * TABLES_BATCH)).view(-1)


def test_sigterm_mid_push_on_two_ps_checkpoints_one_step_of_every_table_and_resumes_exactly_once(
    start_job, run_job, tmp_path
):
    """Async on 2 PS, at full speed: a push may reach one PS before training ends and the other after. Every PS
    still ends at one global step, so the final checkpoint's table files (one chain per PS) are of one step and
    the next run applies every record exactly once. (Before PSAdmin.stop held the pushes first, one run in three
    failed here; tests/ps/test_stop.py makes that race certain.)"""
    log = tmp_path / "steps.jsonl"
    job = start_job("tables.py", **TABLES_JOB, step_log=str(log))
    wait_for_steps(log, job.proc, 60)
    roles = list(job.roles().values())
    job.proc.send_signal(signal.SIGTERM)
    returncode, _ = wait_for_exit(job.proc, roles, time.monotonic())
    out = job.finish(5)[1]
    assert returncode == PREEMPTED_EXIT_CODE, out
    stopped_at = manifest_step(tmp_path / "model")
    chief_log = (tmp_path / "model" / "logs" / "chief.log").read_text()
    assert f"at global step {stopped_at}; the next run resumes from it" in chief_log, chief_log + out
    assert 0 < stopped_at < TABLES_STEPS, out
    proc, second = run_job("tables.py", timeout_s=120, **TABLES_JOB)
    assert proc.returncode == 0, proc.stdout
    assert (second["start_step"], second["global_step"]) == (stopped_at, TABLES_STEPS)
    applied = _applied_per_record(tmp_path / "model")
    twice, never = (applied > 1).nonzero().view(-1), (applied < 1).nonzero().view(-1)
    assert not twice.numel() and not never.numel(), f"applied twice: {twice.tolist()}; never: {never.tolist()}"
