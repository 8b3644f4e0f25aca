"""The audit job (jobs/audit.py: its final parameters count how many times each record's gradient was applied) under
sf.AllReduceStrategy and `shardflow launch`, with a worker or the chief SIGKILLed at a moment drawn from a fixed
seed: the launcher restarts it, and the job ends by itself at its exact global step with every record applied
exactly once."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import JOBS, finish_launcher, kill_role_after

NUM_RECORDS, BATCH, NUM_WORKERS = 1024, 8, 2
NUM_BATCHES = NUM_RECORDS // BATCH


def _launch(tmp_path: Path, **config) -> subprocess.Popen[str]:
    config = {
        "model_dir": str(tmp_path / "model"),
        "result": str(tmp_path / "result.json"),
        "mode": "allreduce",
        "step_delay_s": 0.03,
        "step_log": str(tmp_path / "steps.log"),
        **config,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", str(NUM_WORKERS), "--ps", "0"]
    command += ["--max-restarts", "2", "--restart-backoff", "0.1", str(JOBS / "audit.py"), str(path)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_at_random(launcher: subprocess.Popen[str], steps_log: Path, role: str, seed: int) -> None:
    """SIGKILL `role`'s process once the workers computed a number of batches drawn from `seed`."""
    kill_role_after(launcher, steps_log, role, random.Random(seed).randint(10, NUM_BATCHES - 30))


def _assert_every_record_applied_once(tmp_path: Path, output: str, accumulation: int = 1) -> None:
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == NUM_BATCHES // NUM_WORKERS // accumulation, output
    # Each step averages a record's gradient over the workers and the batches each accumulated: an applied record
    # adds 1 / (NUM_WORKERS x accumulation), a power of two (exact).
    applied = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))["seen"] * NUM_WORKERS * accumulation
    counts = torch.bincount(applied.round().long().clamp(min=0), minlength=3)
    assert torch.equal(applied, torch.ones_like(applied)), f"records applied 0, 1, 2.. times: {counts.tolist()}"


@pytest.mark.parametrize(
    ("role", "seed", "accumulation"), [("worker:0", 11, 1), ("worker:1", 12, 1), ("worker:1", 13, 2)]
)
def test_a_worker_of_the_allreduce_audit_job_killed_at_random_every_record_is_applied_once(
    tmp_path, role, seed, accumulation
):
    launcher = _launch(tmp_path, save_checkpoints_steps=8, accumulation=accumulation)
    _kill_at_random(launcher, tmp_path / "steps.log", role, seed)
    output = finish_launcher(launcher, 180)
    assert launcher.returncode == 0, output
    assert f"{role} (pid" in output and "restarting it" in output, output
    _assert_every_record_applied_once(tmp_path, output, accumulation)


@pytest.mark.parametrize(("checkpoint_steps", "seed"), [(None, 21), (4, 22)])
def test_the_chief_of_the_allreduce_audit_job_killed_at_random_every_record_is_applied_once(
    tmp_path, checkpoint_steps, seed
):
    launcher = _launch(tmp_path, save_checkpoints_steps=checkpoint_steps)
    _kill_at_random(launcher, tmp_path / "steps.log", "chief", seed)
    output = finish_launcher(launcher, 180)
    assert launcher.returncode == 0, output
    assert "adopted the live all-reduce group" in output, output
    _assert_every_record_applied_once(tmp_path, output)
