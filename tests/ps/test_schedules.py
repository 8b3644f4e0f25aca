"""Learning-rate schedules on the PS: the closed forms against torch's schedulers stepped in one process, and
real PS setting each global step's learning rate, also after a restore."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from shardflow.comm.errors import CommError
from shardflow.ps.client import PushRequest
from shardflow.ps.optimizers import SGD, Adam
from shardflow.ps.placement import place
from shardflow.ps.schedules import ScheduleSpec, as_schedule
from shardflow.ps.sparse import sparse_variables
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import fetch_state, init_servers

lr_scheduler = torch.optim.lr_scheduler

CASES: list[tuple[str, dict[str, Any]]] = [
    ("StepLR", {"step_size": 3, "gamma": 0.5}),
    ("StepLR", {"step_size": 4}),
    ("MultiStepLR", {"milestones": [7, 2, 11], "gamma": 0.3}),
    ("ExponentialLR", {"gamma": 0.9}),
    ("CosineAnnealingLR", {"T_max": 10, "eta_min": 0.001}),
    ("CosineAnnealingLR", {"T_max": 7}),
    ("LinearLR", {"start_factor": 0.1, "total_iters": 6}),
    ("LinearLR", {}),
    ("ConstantLR", {"factor": 0.5, "total_iters": 4}),
    ("PolynomialLR", {"total_iters": 12, "power": 2.0}),
    ("OneCycleLR", {"max_lr": 0.4, "total_steps": 30, "cycle_momentum": False}),
    ("OneCycleLR", {"max_lr": 0.4, "total_steps": 30, "cycle_momentum": False, "anneal_strategy": "linear"}),
    ("OneCycleLR", {"max_lr": 0.4, "epochs": 3, "steps_per_epoch": 10, "cycle_momentum": False, "three_phase": True}),
]


def _torch_lrs(name: str, kwargs: dict[str, Any], num_steps: int, base_lr: float) -> list[float]:
    """The learning rate of each of `num_steps` updates with torch's scheduler stepped after each, in one process."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    scheduler = getattr(lr_scheduler, name)(optimizer, **kwargs)
    lrs = []
    for _ in range(num_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_learning_rate_at_each_global_step_equals_torch_scheduler_in_one_process(name, kwargs):
    spec = as_schedule(functools.partial(getattr(lr_scheduler, name), **kwargs))
    steps = 30
    expected = _torch_lrs(name, kwargs, steps, base_lr=0.2)
    got = [spec.lr(step, 0.2) for step in range(steps)]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))


def test_a_scheduler_class_alone_takes_torch_defaults():
    assert as_schedule(lr_scheduler.LinearLR) == ScheduleSpec("LinearLR", {})


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (functools.partial(lr_scheduler.LambdaLR, lr_lambda=[lambda step: 0.9**step]), "one lr_lambda function"),
        (functools.partial(lr_scheduler.MultiplicativeLR, lr_lambda=lambda step: 0.9), "cannot replay"),
        (lr_scheduler.ReduceLROnPlateau, "Supported: .*CosineAnnealingLR"),
        (functools.partial(lr_scheduler.StepLR), "StepLR needs step_size"),
        (functools.partial(lr_scheduler.OneCycleLR, max_lr=0.1, total_steps=10), "cycle_momentum=False"),
        (lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), 2), "bound to an optimizer"),
        ("cosine", "not a learning-rate scheduler"),
    ],
)
def test_unsupported_schedules_are_refused_saying_what_is_supported(schedule, message):
    with pytest.raises(ValueError, match=message):
        as_schedule(schedule)


def test_the_ps_set_each_steps_learning_rate_and_a_restored_ps_goes_on_at_its_step(start_cluster):
    cluster = start_cluster(2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    placement = place(model.named_parameters(), 2)
    assert {piece.ps for piece in placement.pieces} == {0, 1}
    spec = SGD(lr=0.5)
    spec = type(spec)(spec.name, spec.kwargs, schedule=ScheduleSpec("StepLR", {"step_size": 2, "gamma": 0.1}))
    chief = cluster.client(model, placement)
    init_servers(chief, spec, ApplyConfig(num_workers=1))
    worker = cluster.client(model, placement)
    expected_lrs = _torch_lrs("StepLR", {"step_size": 2, "gamma": 0.1}, 5, base_lr=0.5)

    def push_ones_and_check(step: int) -> None:
        before = {k: v.detach().clone() for k, v in worker.named.items()}
        worker.begin_push(step)
        for param in worker.named.values():
            param.grad = torch.ones_like(param)
        assert worker.wait_push(worker.push(PushRequest())).step == step + 1
        for name, param in worker.named.items():
            torch.testing.assert_close(param.detach(), before[name] - expected_lrs[step], rtol=0, atol=1e-6)

    for step in range(3):
        push_ones_and_check(step)
    # The same job restored from the state at global step 3, onto fresh PS: its next update uses step 3's rate.
    state = fetch_state(chief)
    restored = start_cluster(2)
    init_servers(restored.client(model, placement), spec, ApplyConfig(num_workers=1), state)
    worker = restored.client(model, placement)
    worker.rejoin()  # its step count goes on from the checkpoint's
    worker.pull()
    push_ones_and_check(3)
    push_ones_and_check(4)


def test_row_sparse_tables_follow_the_schedule_too(cluster):
    model = torch.nn.Embedding(10, 3, sparse=True)
    placement = place(model.named_parameters(), 3, sparse=sparse_variables(model))
    spec = Adam(lr=0.1)
    spec = type(spec)(spec.name, spec.kwargs, schedule=ScheduleSpec("ExponentialLR", {"gamma": 0.5}))
    init_servers(cluster.client(model, placement), spec, ApplyConfig(num_workers=1))
    reference = torch.nn.Embedding(10, 3, sparse=True)
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SparseAdam(reference.parameters(), lr=0.1)
    scheduler = lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    worker = cluster.client(model, placement)
    ids = torch.tensor([1, 4, 4, 7])
    for step in range(3):
        model.zero_grad()
        worker.begin_push(step)
        model(ids).sum().backward()
        worker.wait_push(worker.push(PushRequest()))
        optimizer.zero_grad()
        reference(ids).sum().backward()
        optimizer.step()
        scheduler.step()
    worker.fetch_rows("weight", ids)
    torch.testing.assert_close(model.weight.detach()[ids], reference.weight.detach()[ids])


def test_a_function_of_the_step_and_lambda_lr_give_torch_s_learning_rates():
    warm_up = functools.partial(lr_scheduler.LambdaLR, lr_lambda=lambda step: min(1.0, (step + 1) / 5))
    expected = []
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
    scheduler = warm_up(optimizer)
    for _ in range(12):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    spec = as_schedule(warm_up)
    assert spec.from_workers and spec.to_json() == {"name": "LambdaLR", "kwargs": {}}
    assert [spec.lr(step, 0.2) for step in range(12)] == pytest.approx(expected)
    absolute = as_schedule(lambda step: 0.3 * 0.5 ** (step // 4))
    assert absolute.from_workers and [absolute.lr(s, 99.0) for s in (0, 4, 9)] == [0.3, 0.15, 0.075]
    # What the PS get has no function: they take each update's learning rate from its push.
    on_the_ps = ScheduleSpec.from_json(spec.to_json())
    with pytest.raises(RuntimeError, match="comes with each push"):
        on_the_ps.lr(3, 0.2)


def test_with_a_function_schedule_the_ps_apply_the_learning_rate_each_push_carries(start_cluster):
    cluster = start_cluster(2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    placement = place(model.named_parameters(), 2)
    spec = SGD(lr=0.5)
    spec = type(spec)(spec.name, spec.kwargs, schedule=as_schedule(lambda step: 0.1 * (step + 1)))
    init_servers(cluster.client(model, placement), spec, ApplyConfig(num_workers=1))
    worker = cluster.client(model, placement)
    for step in range(3):
        before = {k: v.detach().clone() for k, v in worker.named.items()}
        worker.begin_push(step)
        for param in worker.named.values():
            param.grad = torch.ones_like(param)
        request = PushRequest(learning_rate=spec.learning_rate(step))
        assert worker.wait_push(worker.push(request)).step == step + 1
        for name, param in worker.named.items():
            torch.testing.assert_close(param.detach(), before[name] - 0.1 * (step + 1), rtol=0, atol=1e-6)
    # A push without its learning rate is refused, naming why.
    worker.begin_push(3)
    for param in worker.named.values():
        param.grad = torch.ones_like(param)
    with pytest.raises(CommError, match="must carry its lr"):
        worker.wait_push(worker.push(PushRequest()))
