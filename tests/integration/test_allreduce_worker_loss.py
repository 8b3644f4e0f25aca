"""Losing a worker of sf.AllReduceStrategy: it is restarted, the group is formed again with it, and the job ends at
its exact global step with every record applied exactly once. Sync all-reduce is deterministic, so the final
parameters must equal one process's trained on the same batches, each once: a record lost or doubled changes them."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import torch

from .test_allreduce_strategy import _one_process, _trained

STEPS, BATCH = 40, 8


def _wait_for_steps(job, steps_log: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while not steps_log.exists() or len(steps_log.read_text().splitlines()) < count:
        assert time.monotonic() < deadline and job.proc.poll() is None, job.finish(5)[1]
        time.sleep(0.05)


def _start(start_job, tmp_path: Path, **config):
    steps_log = tmp_path / "steps.log"
    job = start_job(
        "allreduce.py",
        num_workers=2,
        epochs=1,
        num_batches=2 * STEPS,
        batch=BATCH,
        lr=0.1,
        step_delay_s=0.05,
        step_log=str(steps_log),
        max_restarts=2,
        restart_backoff_s=0.1,
        **config,
    )
    return job, steps_log


def _assert_every_record_applied_once(tmp_path: Path, output: str) -> None:
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == STEPS, output
    expected = _one_process(
        [slice(2 * s * BATCH, (2 * s + 2) * BATCH) for s in range(STEPS)], "sgd", 0.1, 2 * STEPS * BATCH
    )
    trained = _trained(tmp_path / "model")
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0)


def test_a_killed_worker_rejoins_and_every_record_is_applied_once(start_job, tmp_path):
    job, steps_log = _start(start_job, tmp_path)
    _wait_for_steps(job, steps_log, 20)  # about 10 global steps in
    job.roles()["worker:1"].kill()
    code, output = job.finish(120)
    assert code == 0, output
    assert "restarting it" in output and "joined the all-reduce group at global step" in output, output
    _assert_every_record_applied_once(tmp_path, output)


def test_a_killed_worker_resumes_its_input_from_its_last_checkpointed_position(start_job, tmp_path):
    job, steps_log = _start(start_job, tmp_path, save_checkpoints_steps=4)
    _wait_for_steps(job, steps_log, 30)
    job.roles()["worker:1"].kill()
    code, output = job.finish(120)
    assert code == 0, output
    _assert_every_record_applied_once(tmp_path, output)


def test_a_killed_worker_0_rejoins_and_hands_over_every_state_after_it(start_job, tmp_path):
    # A state handed over at every step: the kill may land inside a hand-over, which the restarted worker:0 redoes.
    job, steps_log = _start(start_job, tmp_path, save_checkpoints_steps=1)
    _wait_for_steps(job, steps_log, 24)
    job.roles()["worker:0"].kill()
    code, output = job.finish(120)
    assert code == 0, output
    _assert_every_record_applied_once(tmp_path, output)


def test_a_worker_not_back_within_worker_rejoin_timeout_fails_the_job_naming_it(start_job, tmp_path):
    job, steps_log = _start(start_job, tmp_path, request_timeout_s=2, worker_rejoin_timeout_s=3)
    _wait_for_steps(job, steps_log, 10)
    stopped = job.roles()["worker:1"]
    stopped.send_signal(signal.SIGSTOP)  # alive but silent: the launcher does not restart it
    try:
        code, output = job.finish(90)
    finally:
        if psutil.pid_exists(stopped.pid):
            stopped.send_signal(signal.SIGCONT)
    assert code != 0
    assert "worker:1 did not join generation 1 of the all-reduce group within worker_rejoin_timeout_s=3s" in output
