"""Real local clusters in which worker:1 produces a NaN loss or inf gradients: nothing non-finite is ever applied,
the job fails naming the worker and the step, or, with a higher limit, goes on with an exact global step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardflow as sf


def _latest_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    root = model_dir / "checkpoints"
    return load_file(str(root / (root / "latest").read_text() / "model.safetensors"))


def _all_finite(params: dict[str, torch.Tensor]) -> bool:
    return bool(params) and all(bool(torch.isfinite(value).all()) for value in params.values())


def test_a_nan_loss_fails_the_job_naming_the_worker_and_the_step(run_job, tmp_path):
    # sync, 2 workers: worker:1's local step k is computed on the parameters of global step k.
    proc, _ = run_job(
        "nonfinite.py",
        mode="sync",
        max_steps=100,
        nonfinite_loss_at=[20],
        save_checkpoints_steps=2,
        step_delay_s=0.05,
        timeout_s=60,
    )
    assert proc.returncode != 0, proc.stdout
    assert "worker:1 computed a NaN or inf loss at global step 20 (1 of at most 1); none were applied" in proc.stdout
    assert _all_finite(_latest_checkpoint(tmp_path / "model"))


@pytest.mark.parametrize("num_ps", [1, 2])
def test_inf_gradients_fail_an_async_job_naming_the_worker(run_job, tmp_path, num_ps):
    # With 2 PS the worker finds the inf and tells both PS; with 1 that PS finds it in the push and refuses it.
    proc, _ = run_job(
        "nonfinite.py",
        mode="async",
        max_steps=200,
        inf_gradients_at=[20],
        save_checkpoints_steps=2,
        step_delay_s=0.05,
        num_ps=num_ps,
    )
    assert proc.returncode != 0, proc.stdout
    assert "worker:1 pushed NaN or inf gradients at global step " in proc.stdout, proc.stdout
    assert "(1 of at most 1); none were applied" in proc.stdout
    assert _all_finite(_latest_checkpoint(tmp_path / "model"))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_with_a_higher_limit_the_job_completes_at_its_exact_global_step(run_job, tmp_path, mode):
    proc, result = run_job(
        "nonfinite.py",
        mode=mode,
        max_steps=30,
        nonfinite_loss_at=[2],
        inf_gradients_at=[5],
        max_nonfinite_updates=3,
        step_delay_s=0.01,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 30
    # Both refusals reached every PS, and neither was a step there.
    for stats in result["ps_stats"].values():
        assert (stats["step"], stats["applied"]) == (30, 30)
        assert (stats["nonfinite"], stats["nonfinite/worker:1"]) == (2, 2)
    assert _all_finite(_latest_checkpoint(tmp_path / "model"))


def test_max_nonfinite_updates_must_be_a_positive_int():
    with pytest.raises(ValueError, match="max_nonfinite_updates must be an int >= 1"):
        sf.ParameterServerStrategy(max_nonfinite_updates=0)
