"""Plain PyTorch objects in the Estimator: a module in place of model_fn, torch.optim and lr_scheduler classes
turned into the specs sent to the PS, and everything else refused saying what is supported."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import shardflow as sf
from shardflow.ps import protocol
from shardflow.ps.optimizers import OptimizerSpec, as_optimizer_spec
from shardflow.ps.protocol import PSProtocolError
from shardflow.ps.schedules import ScheduleSpec
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.job import build_model

ADAM: Any = torch.optim.Adam  # called with a wrong argument on purpose


def _loss(model, batch):
    return model(batch).sum()


def test_a_module_instance_is_copied_with_its_values_for_each_role():
    net = torch.nn.Linear(3, 2)
    est = sf.Estimator(net, _loss)
    first, second = est.build_model(), est.build_model()
    assert first is not net and second is not first
    for model in (first, second):
        for name, value in net.state_dict().items():
            assert torch.equal(model.state_dict()[name], value)
    with torch.no_grad():
        next(first.parameters()).add_(1.0)
    assert not torch.equal(next(first.parameters()), net.weight)


def test_a_model_function_still_builds_the_same_values_from_the_seed():
    first, second = (build_model(lambda: torch.nn.Linear(3, 2), 7) for _ in range(2))
    assert torch.equal(next(first.parameters()), next(second.parameters()))


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (torch.optim.Adam, OptimizerSpec("Adam", {})),
        (
            functools.partial(torch.optim.Adam, lr=1e-3, betas=(0.8, 0.99)),
            OptimizerSpec("Adam", {"lr": 1e-3, "betas": [0.8, 0.99]}),
        ),
        (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), OptimizerSpec("SGD", {"lr": 0.1, "momentum": 0.9})),
        (torch.optim.RMSprop, OptimizerSpec("RMSprop", {})),
        (sf.optim.AdamW(lr=0.01), sf.optim.AdamW(lr=0.01)),
    ],
)
def test_torch_optim_classes_become_the_spec_the_ps_build(optimizer, expected):
    assert as_optimizer_spec(optimizer) == expected


def test_a_class_with_its_defaults_builds_torchs_own_optimizer_on_the_ps():
    params = [torch.zeros(3, requires_grad=True)]
    built = as_optimizer_spec(torch.optim.Adam).build(params)
    assert built.defaults == torch.optim.Adam(params).defaults


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        (torch.optim.Adam([torch.zeros(1, requires_grad=True)]), "bound to this process's parameters.*Supported: "),
        (torch.optim.LBFGS, "LBFGS is not applied element by element.*Supported: "),
        (functools.partial(torch.optim.SGD, [torch.zeros(1)], 0.1), "by keyword"),
        ("adam", r"not a torch.optim optimizer. Supported: sf.optim.\{SGD, Adam, AdamW, Adagrad, RMSprop\}"),
        (functools.partial(ADAM, eps="small"), "must be a number"),
    ],
)
def test_unsupported_optimizers_are_refused_saying_what_is_supported(optimizer, message):
    with pytest.raises(ValueError, match=message):
        sf.Estimator(lambda: torch.nn.Linear(1, 1), _loss, optimizer)


def test_estimator_adds_the_schedule_and_clipping_to_the_optimizer_spec():
    est = sf.Estimator(
        torch.nn.Linear(1, 1),
        _loss,
        torch.optim.SGD,
        lr_schedule=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10, gamma=0.5),
        clip_grad_norm=1.0,
        clip_grad_value=0.5,
    )
    assert est.optimizer == OptimizerSpec(
        "SGD",
        {},
        schedule=ScheduleSpec("StepLR", {"step_size": 10, "gamma": 0.5}),
        clip_grad_norm=1.0,
        clip_grad_value=0.5,
    )


def _init_header(optimizer: dict[str, object]) -> dict[str, object]:
    init = protocol.Init(
        dtypes=(), num_tables=0, optimizer=sf.optim.SGD(), apply=ApplyConfig(), step=0, frame_counts=()
    )
    return {**init.header(), "optimizer": optimizer}


def test_the_spec_with_schedule_and_clipping_round_trips_through_init():
    spec = OptimizerSpec(
        "Adam", {"lr": 0.1}, schedule=ScheduleSpec("CosineAnnealingLR", {"T_max": 5}), clip_grad_norm=2.0
    )
    decoded = protocol.decode_request(_init_header(spec.to_json()), [], None, "chief")
    assert isinstance(decoded, protocol.Init)
    assert decoded.optimizer == spec


@pytest.mark.parametrize(
    "optimizer",
    [
        {"name": "SGD", "kwargs": {}, "clip_grad_norm": -1.0},
        {"name": "SGD", "kwargs": {}, "clip_grad_value": "big"},
        {"name": "SGD", "kwargs": {}, "schedule": {"name": "LambdaLR", "kwargs": {"lr_lambda": 2}}},
        {"name": "SGD", "kwargs": {}, "schedule": {"name": "MultiplicativeLR", "kwargs": {}}},
        {"name": "SGD", "kwargs": {}, "schedule": {"name": "StepLR", "kwargs": {"step_size": 2}, "extra": 1}},
        {"name": "SGD", "kwargs": {}, "momentum_schedule": None},
    ],
)
def test_init_refuses_a_malformed_schedule_or_clipping(optimizer):
    with pytest.raises(PSProtocolError, match="optimizer"):
        protocol.decode_request(_init_header(optimizer), [], None, "chief")


def test_hybrid_strategy_offers_gradient_accumulation():
    assert sf.HybridStrategy(gradient_accumulation_steps=2, sparse_mode="sync").gradient_accumulation_steps == 2


def test_strategy_options_are_checked():
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        sf.ParameterServerStrategy(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="use mixed_precision='bf16'"):
        sf.ParameterServerStrategy(mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"HybridStrategy.mixed_precision='fp16' needs a GradScaler"):
        sf.HybridStrategy(mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"AllReduceStrategy.gradient_accumulation_steps must be an int >= 1"):
        sf.AllReduceStrategy(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match=r"HybridStrategy.gradient_accumulation_steps must be an int >= 1"):
        sf.HybridStrategy(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="save_summary_steps"):
        sf.Estimator(torch.nn.Linear(1, 1), _loss, save_summary_steps=0)
