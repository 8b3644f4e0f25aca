"""sf.AllReduceStrategy's pieces in one process: its config's validation, the gradient buckets (a real gloo group of
one rank formed through a real control service), and a model state's round trip through the control plane."""

from __future__ import annotations

import pytest
import torch

import shardflow as sf
from shardflow.cluster.dist_store import ControlPlaneStore, gloo_group
from shardflow.train import allreduce_state
from shardflow.train.allreduce_gradients import GradientReducer


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_workers", 0), ("bucket_bytes", 0), ("request_timeout_s", 0), ("fail_on_save_error", "yes")],
)
def test_the_strategy_refuses_a_bad_field_naming_it(field, value):
    with pytest.raises(ValueError, match=f"AllReduceStrategy.{field}"):
        sf.AllReduceStrategy(**{field: value})


def test_gradients_are_bucketed_by_dtype_and_size_and_averaged_over_the_contributors(plane):
    group = gloo_group(ControlPlaneStore(plane, "units", 0, ["worker:0"], 5), 0, 1, "127.0.0.1", 5)
    params = [torch.nn.Parameter(torch.zeros(100)), torch.nn.Parameter(torch.zeros(100))]
    params.append(torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    reducer = GradientReducer(group, params, bucket_bytes=500)  # one float32 parameter of 400 bytes per bucket
    assert [[p.numel() for p in bucket] for bucket in reducer.buckets] == [[100], [100], [3]]
    for value, param in enumerate(params, start=1):
        param.grad = torch.full_like(param, 2.0 * value)
    flags = reducer.reduce([1.0, 0.0, 1.0, 0.0, 0.0])
    assert flags == [1.0, 0.0, 1.0, 0.0, 0.0]
    reducer.apply(2.0)
    for value, param in enumerate(params, start=1):
        assert param.grad is not None and torch.equal(param.grad, torch.full_like(param, float(value)))


def test_a_state_with_adam_slots_goes_through_the_control_plane_and_restores_exactly(plane):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    state = allreduce_state.capture(model, optimizer, step=7)
    assert set(state.slots) == {"exp_avg", "exp_avg_sq"} and state.scalars == {"step": 1.0}
    chunks = allreduce_state.encode(state)
    assert allreduce_state.stream(plane, "units", chunks, reader_gone=lambda: False)
    received = allreduce_state.receive(
        plane, "units", len(chunks), step=7, scalars=state.scalars, waiting_for="the test's state", delete=True
    )
    assert not plane.is_set("state/units/0")
    other = torch.nn.Linear(3, 2)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.1)
    allreduce_state.restore(other, other_optimizer, received)
    again = allreduce_state.capture(other, other_optimizer, step=7)
    assert again.scalars == state.scalars
    for name, value in state.params.items():
        assert torch.equal(again.params[name], value)
    for key, by_name in state.slots.items():
        for name, value in by_name.items():
            assert torch.equal(again.slots[key][name], value)
