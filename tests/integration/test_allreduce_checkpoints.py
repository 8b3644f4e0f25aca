"""sf.AllReduceStrategy's checkpoints are the PS strategy's: the same tensors and manifest as a sync PS job's, and a
checkpoint of either strategy restores into the other and trains on as one process would."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

BATCH = 8


def _latest(model_dir: Path) -> Path:
    root = model_dir / "checkpoints"
    return root / (root / "latest").read_text()


def _one_process_adam(steps: int, lr: float) -> torch.nn.Module:
    """The jobs' model trained with Adam in one process on the two workers' batches together (2b a step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(100 * BATCH, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(100 * BATCH, 1, generator=generator)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        rows = slice(2 * step * BATCH, (2 * step + 2) * BATCH)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return model


def _assert_trained_as_one_process(model_dir: Path, steps: int) -> None:
    trained = load_file(str(_latest(model_dir) / "model.safetensors"))
    for name, expected in _one_process_adam(steps, lr=0.01).state_dict().items():
        torch.testing.assert_close(trained[name], expected, atol=1e-5, rtol=0)


def _run(run_job, strategy: str, model_dir: Path, max_steps: int, **config):
    proc, result = run_job(
        "allreduce.py",
        strategy=strategy,
        model_dir=str(model_dir),
        optimizer="adam",
        lr=0.01,
        num_workers=2,
        max_steps=max_steps,
        **config,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == max_steps
    return result


def test_an_all_reduce_checkpoint_holds_what_a_sync_ps_checkpoint_holds(run_job, tmp_path):
    _run(run_job, "ps", tmp_path / "ps", 6)
    _run(run_job, "allreduce", tmp_path / "allreduce", 6)
    ps, allreduce = _latest(tmp_path / "ps"), _latest(tmp_path / "allreduce")
    ps_tensors = load_file(str(ps / "model.safetensors"))
    allreduce_tensors = load_file(str(allreduce / "model.safetensors"))
    assert set(allreduce_tensors) == set(ps_tensors)
    assert any(name.startswith("slot::exp_avg::") for name in allreduce_tensors)
    for name, value in ps_tensors.items():
        torch.testing.assert_close(allreduce_tensors[name], value, atol=1e-5, rtol=0)
    ps_manifest = json.loads((ps / "manifest.json").read_text())
    allreduce_manifest = json.loads((allreduce / "manifest.json").read_text())
    assert set(allreduce_manifest) - {"ps_stats"} == set(ps_manifest) - {"ps_stats"}
    assert allreduce_manifest["scalars"] == ps_manifest["scalars"] == {"step": 6.0}
    assert allreduce_manifest["iterators"] == ps_manifest["iterators"]
    assert allreduce_manifest["mode"] == "allreduce" and allreduce_manifest["num_ps"] == 0


def test_periodic_checkpoints_are_written_at_exact_steps(run_job, tmp_path):
    _run(run_job, "allreduce", tmp_path / "model", 7, save_checkpoints_steps=3)
    names = sorted(path.name for path in (tmp_path / "model" / "checkpoints").glob("ckpt-*"))
    assert names == ["ckpt-000000003", "ckpt-000000006", "ckpt-000000007"]


def test_a_ps_checkpoint_restores_into_an_all_reduce_job_which_trains_on(run_job, tmp_path):
    _run(run_job, "ps", tmp_path / "model", 4)
    result = _run(run_job, "allreduce", tmp_path / "model", 9)
    assert result["start_step"] == 4
    _assert_trained_as_one_process(tmp_path / "model", 9)


def test_an_all_reduce_checkpoint_restores_into_a_ps_job_which_trains_on(run_job, tmp_path):
    _run(run_job, "allreduce", tmp_path / "model", 4)
    result = _run(run_job, "ps", tmp_path / "model", 9)
    assert result["start_step"] == 4
    _assert_trained_as_one_process(tmp_path / "model", 9)
