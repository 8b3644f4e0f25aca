"""Losing the chief of sf.AllReduceStrategy: `shardflow launch` restarts it, the workers wait for it (their control
plane requests are sent again) and put again what it needs of them, and the restarted chief adopts the live group
rather than restore a checkpoint over it. The job ends at its exact global step with parameters equal to one
process's trained on every batch once. The moment of the kill is drawn at random from a fixed seed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import JOBS, finish_launcher, kill_role_after
from .test_allreduce_strategy import _one_process, _trained

STEPS, BATCH = 40, 8


def _launch(tmp_path: Path, **config) -> subprocess.Popen[str]:
    config = {
        "model_dir": str(tmp_path / "model"),
        "result": str(tmp_path / "result.json"),
        "num_workers": 2,
        "epochs": 1,
        "num_batches": 2 * STEPS,
        "batch": BATCH,
        "lr": 0.1,
        "step_delay_s": 0.05,
        "step_log": str(tmp_path / "steps.log"),
        **config,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", "0"]
    command += ["--max-restarts", "2", "--restart-backoff", "0.1", str(JOBS / "allreduce.py"), str(path)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _assert_every_batch_applied_once(tmp_path: Path, output: str) -> None:
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == STEPS, output
    batches = [slice(2 * s * BATCH, (2 * s + 2) * BATCH) for s in range(STEPS)]
    expected = _one_process(batches, "sgd", 0.1, 2 * STEPS * BATCH)
    trained = _trained(tmp_path / "model")
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_chief_killed_without_checkpoints_is_restarted_and_adopts_the_live_group(tmp_path, seed):
    launcher = _launch(tmp_path)
    kill_role_after(launcher, tmp_path / "steps.log", "chief", random.Random(seed).randint(6, 2 * STEPS - 20))
    output = finish_launcher(launcher, 150)
    assert launcher.returncode == 0, output
    assert "the chief was restarted: adopted the live all-reduce group at global step" in output, output
    _assert_every_batch_applied_once(tmp_path, output)


@pytest.mark.parametrize("seed", [3, 4])
def test_a_chief_killed_amid_hand_overs_saves_them_again_and_restores_no_checkpoint(tmp_path, seed):
    # A state handed over every 2 steps: the kill lands inside one or between two, each in flight put again.
    launcher = _launch(tmp_path, save_checkpoints_steps=2)
    kill_role_after(launcher, tmp_path / "steps.log", "chief", random.Random(seed).randint(6, 2 * STEPS - 20))
    output = finish_launcher(launcher, 150)
    assert launcher.returncode == 0, output
    assert "adopted the live all-reduce group" in output, output
    _assert_every_batch_applied_once(tmp_path, output)
