"""A PS restarted exactly while the chief asks something of it (SHARDFLOW_FAULT: the PS SIGKILLs itself before it
answers) never fails the chief: it restores every PS, tells them again what a restore does not carry (training
stopped, a worker lost), and the job ends at its exact global step with every record's gradient applied once
(tests/integration/jobs/audit.py). The moments: the final checkpoint's fetch of the PS's state, the `stop` of a
preemption, the `lost` of a worker under lost_worker_policy "continue"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from .test_hung_roles import _finish
from .test_worker_loss import BATCH, JOBS, NUM_RECORDS, _audit, _role, _run, _wait_for_training, _write_config

RESTORED = "was lost and restarted: every PS restored to global step"


def _fault(tmp_path: Path, point: str, **step: int) -> dict[str, str]:
    """The environment that has ps:1 SIGKILL itself at `point` (at `step`, when given), once."""
    fault = {"role": "ps:1", "point": point, "marker": str(tmp_path / "fault.fired"), **step}
    return {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault)}


def _start(tmp_path: Path, env: dict[str, str], **config: Any) -> subprocess.Popen[str]:
    path = _write_config(tmp_path, **config)
    command = [sys.executable, str(JOBS / "audit.py"), str(path)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_ps_killed_as_the_chief_fetches_the_final_checkpoint_is_restored_and_the_job_ends_exact(tmp_path):
    # Checkpoints at 48 and 96: the restore goes back to 96, and the workers do the last 32 steps again.
    config = _write_config(tmp_path, save_checkpoints_steps=48, step_delay_s=0.005)
    env = _fault(tmp_path, "state", step=NUM_RECORDS // BATCH)
    returncode, out = _run([sys.executable, str(JOBS / "audit.py"), str(config)], env)
    assert returncode == 0, out
    assert (tmp_path / "fault.fired").exists()
    assert "as training ended; every PS is restored next" in out, out
    assert f"ps:1 {RESTORED} 96" in out, out
    _audit(tmp_path)


def test_a_ps_killed_as_the_chief_tells_it_to_stop_is_restored_and_told_again(tmp_path):
    # SIGTERM: the chief ends training at one step: `hold` (every PS holds pushes), then `stop`. The hold kills
    # ps:1 while ps:0 holds: the restore ends that hold too (a kill at `stop` takes the same path, 13 s more).
    env = _fault(tmp_path, "hold")
    proc = _start(tmp_path, env, num_records=4 * NUM_RECORDS, step_delay_s=0.01, save_checkpoints_steps=32)
    try:
        _wait_for_training(proc, tmp_path, 1.5)
        proc.send_signal(signal.SIGTERM)
    finally:
        out = _finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert (tmp_path / "fault.fired").exists()
    assert "as the chief ended training; every PS is restored next, then told" in out, out
    assert f"ps:1 {RESTORED}" in out, out
    # The next run resumes from the preempted run's final checkpoint and ends exact.
    returncode, rerun = _run([sys.executable, str(JOBS / "audit.py"), str(tmp_path / "config.json")], env)
    assert returncode == 0, rerun
    _audit(tmp_path, num_records=4 * NUM_RECORDS, resumed=True)


def test_a_ps_killed_as_the_chief_tells_it_a_worker_is_lost_is_restored_and_told_again(tmp_path):
    # worker:1 stopped for good: lost after 1 s ("continue": the PS are told), killed and restarted after 3 s.
    env = _fault(tmp_path, "lost")
    config = {"heartbeat_timeout_s": 1.0, "hung_timeout_s": 3.0, "lost_worker_policy": "continue"}
    proc = _start(tmp_path, env, num_records=8 * NUM_RECORDS, step_delay_s=0.01, save_checkpoints_steps=64, **config)
    try:
        _wait_for_training(proc, tmp_path, 1.0)
        _role(proc, "worker:1").send_signal(signal.SIGSTOP)
    finally:
        out = _finish(proc)
    assert proc.returncode == 0, out
    assert (tmp_path / "fault.fired").exists()
    assert "as the chief told it worker:1 is lost; every PS is restored next" in out, out
    assert f"ps:1 {RESTORED}" in out, out
    _audit(tmp_path, num_records=8 * NUM_RECORDS)
