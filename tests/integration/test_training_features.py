"""Real local clusters trained as a plain PyTorch user writes it (a module instance, torch.optim and
torch.optim.lr_scheduler classes), with gradient accumulation, clipping, mixed precision and summaries."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensorboard.compat.proto.event_pb2 import Event

from shardflow.data import TFRecordDataset


def _data(num_batches: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of jobs/features.py."""
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(num_batches * batch, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(num_batches * batch, 1, generator=generator)
    return x, y


def _one_process(
    steps: int,
    batches_per_step: int,
    batch: int,
    change_gradients: Callable[[torch.nn.Module], Any],
    warm_up: int | None = None,
) -> dict[str, torch.Tensor]:
    """jobs/features.py's model trained in one process with SGD(lr=0.1), each step on the next
    `batches_per_step` batches concatenated, its gradient changed by `change_gradients` before the step; with
    `warm_up`, LambdaLR raises the learning rate linearly over that many steps."""
    x, y = _data(steps * batches_per_step, batch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    factor = (lambda step: min(1.0, (step + 1) / warm_up)) if warm_up else (lambda step: 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=factor)
    rows = batches_per_step * batch
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(
            model(x[step * rows : (step + 1) * rows]), y[step * rows : (step + 1) * rows]
        )
        loss.backward()
        change_gradients(model)
        optimizer.step()
        scheduler.step()
    return dict(model.state_dict())


def test_sync_accumulating_two_batches_and_clipping_the_global_norm_on_two_ps_equals_one_process(run_job):
    # One job for the three (with a LambdaLR warm-up, a function of the step), as jobs are slow to start:
    # tests/ps/test_clipping.py pins the clipping alone, tests/ps/test_schedules.py the schedules.
    steps = 4
    proc, result = run_job(
        "features.py",
        mode="sync",
        num_ps=2,
        num_workers=2,
        num_batches=4 * steps,
        gradient_accumulation_steps=2,
        clip_grad_norm=0.3,
        lr_warm_up_steps=3,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps

    # Step s: worker 0 reads batches 4s and 4s + 2, worker 1 batches 4s + 1 and 4s + 3.
    def clip(model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)

    expected = _one_process(steps, 4, 8, clip, warm_up=3)
    unclipped = _one_process(steps, 4, 8, lambda model: None, warm_up=3)
    without_warm_up = _one_process(steps, 4, 8, clip)
    assert not torch.allclose(expected["0.weight"], without_warm_up["0.weight"], atol=1e-3)  # so did the warm-up
    assert not torch.allclose(expected["0.weight"], unclipped["0.weight"], atol=1e-3)  # the clipping mattered
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(result["params"][name]), value, rtol=0, atol=1e-5)


def _scalars(model_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every training scalar TensorBoard would show: tag -> [(global step, value)]."""
    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in sorted((model_dir / "tensorboard").glob("events.out.tfevents.*")):
        for record in TFRecordDataset(str(path)):
            event = Event.FromString(record)
            for value in event.summary.value:
                scalars[value.tag].append((event.step, value.simple_value))
    return scalars


def test_plain_pytorch_objects_with_bf16_autocast_and_a_schedule_train_and_summarise_every_n_steps(run_job, tmp_path):
    proc, result = run_job(
        "features.py",
        mode="sync",
        num_ps=1,
        num_workers=1,
        num_batches=40,
        max_steps=10,
        mixed_precision="bf16",
        lr_schedule={"name": "StepLR", "kwargs": {"step_size": 4, "gamma": 0.5}},
        save_summary_steps=3,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 10
    scalars = _scalars(tmp_path / "model")
    # The mean loss of the batches computed on global steps [0, 3), [3, 6), [6, 9), and of the last, [9, 10).
    assert [step for step, _ in scalars["loss"]] == [3, 6, 9, 10]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    torch_lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(10):
        optimizer.step()
        schedule.step()
        torch_lrs.append(optimizer.param_groups[0]["lr"])
    assert scalars["learning_rate"] and scalars["learning_rate"][-1][0] == 10
    for step, lr in scalars["learning_rate"]:
        assert abs(lr - torch_lrs[step]) < 1e-7, (step, lr)
