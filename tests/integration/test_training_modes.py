"""Real local clusters (chief, PS and workers as processes on 127.0.0.1) training a real model."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file


def _trained(model_dir: Path) -> dict[str, torch.Tensor]:
    root = model_dir / "checkpoints"
    return load_file(str(root / (root / "latest").read_text() / "model.safetensors"))


def test_sync_two_workers_equals_single_process_large_batch(run_job, tmp_path):
    steps, batch = 10, 8
    proc, result = run_job(
        "regression.py",
        mode="sync",
        num_workers=2,
        num_ps=2,
        epochs=1,
        num_batches=2 * steps,
        batch=batch,
        lr=0.1,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps

    # The same model trained in one process on the two workers' batches concatenated (batch 2b).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(2 * steps * batch, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(2 * steps * batch, 1, generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        rows = slice(2 * step * batch, (2 * step + 2) * batch)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()

    trained = _trained(tmp_path / "model")
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(trained[name], expected, atol=1e-5, rtol=0)


def test_sync_training_through_shared_memory_equals_training_through_the_socket(run_job, tmp_path):
    steps = 12
    trained, lane_pushes = {}, {}
    for setting in ("on", "off"):
        model_dir = tmp_path / setting
        proc, result = run_job(
            "regression.py",
            env={"SHARDFLOW_SHARED_MEMORY": setting},
            model_dir=str(model_dir),
            mode="sync",
            num_workers=2,
            num_ps=2,
            epochs=1,
            num_batches=2 * steps,
            hidden=64,
        )
        assert proc.returncode == 0, proc.stdout
        assert result["global_step"] == steps
        trained[setting] = _trained(model_dir)
        lane_pushes[setting] = [stats["lane_pushes"] for stats in result["ps_stats"].values()]
    # Every push of both workers to both PS went through the lanes, or none did.
    assert lane_pushes == {"on": [2 * steps, 2 * steps], "off": [0, 0]}
    for name, expected in trained["off"].items():
        assert torch.equal(trained["on"][name], expected), name


def test_async_four_workers_one_epoch_of_100_batches_gives_global_step_100(run_job):
    proc, result = run_job("regression.py", mode="async", num_workers=4, num_ps=2, epochs=1, num_batches=100)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 100
    assert sum(result["worker_steps"].values()) == 100
    assert result["est_global_step"] == 100
    # Every PS applied every worker update exactly once.
    assert [stats["step"] for stats in result["ps_stats"].values()] == [100, 100]


def test_sync_five_workers_twenty_steps_gives_global_step_20(run_job):
    proc, result = run_job("regression.py", mode="sync", num_workers=5, num_ps=1, epochs=1, num_batches=100)
    assert proc.returncode == 0, proc.stdout
    assert result["worker_steps"] == {f"worker:{i}": 20 for i in range(5)}
    assert result["global_step"] == 20


def test_async_max_steps_is_exact_and_later_pushes_are_dropped(run_job):
    proc, result = run_job("regression.py", mode="async", num_workers=3, num_ps=2, max_steps=37, num_batches=1000)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 37
    assert [stats["applied"] for stats in result["ps_stats"].values()] == [37, 37]


def test_sync_with_a_backup_worker_drops_and_counts_stale_gradients(run_job):
    proc, result = run_job(
        "regression.py",
        mode="sync",
        num_workers=3,
        replicas_to_aggregate=2,
        num_ps=1,
        max_steps=30,
        num_batches=300,
        # Slow enough that every worker takes part: 30 steps of 2 fast workers are over in a fraction of a second,
        # and a third worker that starts later finds training over (then nothing of it is dropped).
        step_delay_s=0.05,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 30
    stats = result["ps_stats"]["ps:0"]
    # Every gradient pushed before the end was either aggregated (2 per step) or dropped as stale.
    assert stats["applied"] == 30
    assert stats["dropped_stale"] + stats["dropped_after_max_steps"] >= 1, (result["worker_steps"], stats)


def test_ssp_never_lets_a_worker_run_more_than_max_staleness_steps_ahead(run_job, tmp_path):
    log = tmp_path / "steps.jsonl"
    max_staleness = 2
    proc, result = run_job(
        "regression.py",
        mode="ssp",
        num_workers=2,
        num_ps=1,
        epochs=1,
        num_batches=40,
        max_staleness=max_staleness,
        slow_worker_delay_s=0.05,
        step_log=str(log),
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 40
    starts: dict[int, list[float]] = defaultdict(list)
    for line in log.read_text().splitlines():
        event = json.loads(line)
        starts[event["worker"]].append(event["t"])
    assert len(starts[0]) == len(starts[1]) == 20
    max_lead = 0
    for worker, other in ((0, 1), (1, 0)):
        for step, t in enumerate(starts[worker]):
            # Steps the other worker had started by then bound from above the steps it had finished.
            other_started = sum(1 for s in starts[other] if s <= t)
            max_lead = max(max_lead, step - other_started)
    assert max_lead <= max_staleness
    # The slow worker really made the fast one wait: without SSP it would have run far ahead.
    assert max_lead >= 1
