"""A step whose loss or gradients hold NaN or inf is never applied, on any PS: it is refused and counted, is not a
global step, and every PS reaches the same verdict."""

from __future__ import annotations

import torch

from shardflow.comm.client import Client
from shardflow.ps.admin import PSAdmin
from shardflow.ps.client import ParameterClient, PushRequest
from shardflow.ps.optimizers import SGD, Adam
from shardflow.ps.placement import Partitioner, place
from shardflow.ps.protocol import Push, StepReply
from shardflow.ps.update_rules import ApplyConfig, all_finite
from shardflow.train.checkpoints.servers import fetch_state, init_servers

from .test_sparse_rows import BATCHES, Ranker, loss
from .test_sparse_rows import start as start_sparse


def _two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    # No bias in the first layer: placed on 2 PS, ps:0 holds only 0.weight and ps:1 only the last layer.
    return torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _steps_and_refusals(client: PSAdmin, worker_index: int = 0) -> list[tuple[int, float, float]]:
    return [(s.step, s.stats["nonfinite"], s.stats.get(f"nonfinite/worker:{worker_index}", 0)) for s in client.status()]


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_nan_gradients_on_one_ps_are_refused_by_every_ps_and_the_global_step_stays_equal(start_cluster):
    cluster = start_cluster(2)
    model = _two_layers()
    placement = place(model.named_parameters(), 2)
    assert {p.name: p.ps for p in placement.pieces} == {"0.weight": 0, "2.weight": 1, "2.bias": 1}
    chief = cluster.admin(model, placement)
    init_servers(chief, Adam(lr=0.1), ApplyConfig(num_workers=1))
    before = _params(model)

    worker = cluster.client(_two_layers(), placement)
    worker.pull()
    # Backward completes ps:1's pieces (the last layer, finite) before ps:0's, whose only gradient becomes NaN.
    poison = worker.model[0].weight.register_hook(lambda grad: grad * float("nan"))
    worker.begin_push(0)
    worker.model(torch.ones(2, 8)).sum().backward()
    pushed = worker.push(PushRequest())
    reply = worker.wait_push(pushed)

    assert (pushed.nonfinite, reply.nonfinite, reply.step) == ("gradients", 1, 0)
    assert _steps_and_refusals(chief) == [(0, 1, 1), (0, 1, 1)]
    for name, value in _params(worker.model).items():
        assert torch.equal(value, before[name]), name

    # The next finite step is the first update: Adam's slots were never touched by the refused one.
    poison.remove()
    worker.model.zero_grad(set_to_none=True)
    worker.begin_push(0)
    worker.model(torch.ones(2, 8)).sum().backward()
    grads = {name: p.grad.clone() for name, p in worker.model.named_parameters() if p.grad is not None}
    assert worker.wait_push(worker.push(PushRequest())).step == 1
    assert [s.step for s in chief.status()] == [1, 1]
    expected = _two_layers()
    optimizer = torch.optim.Adam(expected.parameters(), lr=0.1)
    for name, param in expected.named_parameters():
        param.grad = grads[name]
    optimizer.step()
    for name, value in fetch_state(chief).params.items():
        torch.testing.assert_close(value, dict(expected.named_parameters())[name].detach(), rtol=0, atol=1e-6)


def test_a_nan_loss_is_refused_by_every_ps_and_its_input_position_is_kept(start_cluster):
    cluster = start_cluster(2)
    model = _two_layers()
    placement = place(model.named_parameters(), 2)
    chief = cluster.admin(model, placement)
    init_servers(chief, SGD(lr=0.1), ApplyConfig(num_workers=2))
    before = _params(model)

    worker = cluster.client(_two_layers(), placement, worker_index=1)
    worker.pull()
    worker.begin_push(0)
    pushed = worker.push(PushRequest(input_state={"batch": 7}, nonfinite_loss=True))
    reply = worker.wait_push(pushed)

    assert (pushed.nonfinite, reply.nonfinite, reply.step) == ("loss", 1, 0)
    assert _steps_and_refusals(chief, worker_index=1) == [(0, 1, 1), (0, 1, 1)]
    state = fetch_state(chief)
    assert state.iterators == {"worker:1": {"batch": 7}}
    for name, value in state.params.items():
        assert torch.equal(value, before[name]), name


def test_inf_in_row_sparse_gradients_is_refused_by_every_ps(start_cluster):
    cluster = start_cluster(2)
    chief, placement = start_sparse(cluster, Adam(lr=0.1), num_ps=2)
    before = fetch_state(chief).params
    worker = cluster.client(Ranker(sparse=True), placement)

    def to_inf(grad: torch.Tensor) -> torch.Tensor:
        return torch.sparse_coo_tensor(
            grad._indices(), grad._values() * float("inf"), grad.shape, check_invariants=False
        )

    worker.model.table.weight.register_hook(to_inf)
    worker.begin_push(0)
    loss(worker.model, BATCHES[0]).backward()
    reply = worker.wait_push(worker.push(PushRequest()))

    assert (reply.nonfinite, reply.step) == (1, 0)
    assert _steps_and_refusals(chief) == [(0, 1, 1), (0, 1, 1)]
    for name, value in fetch_state(chief).params.items():
        assert torch.equal(value, before[name]), name


def _raw_push(address: str, worker_index: int, grad: torch.Tensor, local_step: int) -> StepReply:
    """A push straight to ps:0, past the worker's own check: for the PS's last guard."""
    sender = Client(f"worker:{worker_index}")
    sender.connect("ps:0", address)
    try:
        push = Push(worker_index=worker_index, local_step=local_step, base_step=0, frame_counts=(1,))
        header, _ = sender.request("ps:0", push.header(), [grad], timeout_s=5)
        return StepReply.decode(header, Push.op, "ps:0")
    finally:
        sender.close()


def test_the_ps_refuses_a_nan_push_itself_in_async_mode(start_cluster):
    cluster = start_cluster(1)
    model = torch.nn.Linear(3, 1, bias=False)
    placement = place(model.named_parameters(), 1)
    chief = cluster.admin(model, placement)
    init_servers(chief, SGD(lr=1.0), ApplyConfig(num_workers=2))
    before = _params(model)

    reply = _raw_push(cluster.addresses[0], 1, torch.tensor([1.0, float("nan"), 2.0]), local_step=1)

    assert (reply.nonfinite, reply.step) == (1, 0)
    assert _steps_and_refusals(chief, worker_index=1) == [(0, 1, 1)]
    assert torch.equal(fetch_state(chief).params["weight"], before["weight"])
    assert _raw_push(cluster.addresses[0], 1, torch.tensor([1.0, 1.0, 1.0]), local_step=2).step == 1


def test_sync_a_nan_push_never_reaches_the_sum_of_the_replicas(start_cluster):
    cluster = start_cluster(1)
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    placement = place(model.named_parameters(), 1)
    chief = cluster.admin(model, placement)
    init_servers(chief, SGD(lr=1.0), ApplyConfig(mode="sync", num_workers=2))
    workers = [cluster.client(torch.nn.Linear(2, 1, bias=False), placement, worker_index=i) for i in range(2)]

    def push(worker: ParameterClient, value: float):
        worker.pull()
        worker.begin_push(0)
        param = dict(worker.named)["weight"]
        param.grad = torch.full_like(param, value)
        return worker.push(PushRequest())

    waiting = push(workers[0], 1.0)
    refused = workers[1].wait_push(push(workers[1], float("inf")))
    assert (refused.nonfinite, refused.step) == (1, 0)
    # worker:1 goes on with a gradient of the same version; with worker:0's, it makes the step.
    second = push(workers[1], 3.0)
    assert [w.wait_push(r).step for w, r in zip(workers, [waiting, second], strict=True)] == [1, 1]
    torch.testing.assert_close(fetch_state(chief).params["weight"], torch.full((1, 2), -2.0))
    assert _steps_and_refusals(chief, worker_index=1) == [(1, 1, 1)]


def test_sync_two_ps_count_the_same_steps_when_a_worker_pushes_nan(start_cluster):
    cluster = start_cluster(2)
    model = _two_layers()
    placement = place(model.named_parameters(), 2, Partitioner(fixed_shards=2))
    chief = cluster.admin(model, placement)
    init_servers(chief, SGD(lr=0.1), ApplyConfig(mode="sync", num_workers=2))
    workers = [cluster.client(_two_layers(), placement, worker_index=i) for i in range(2)]
    workers[1].model[2].bias.register_hook(lambda grad: grad.clone().fill_(float("nan")))
    for worker in workers:
        worker.pull()
        worker.begin_push(0)
        worker.model(torch.ones(1, 8)).sum().backward()
    waiting, refused = workers[0].push(PushRequest()), workers[1].push(PushRequest())
    assert workers[1].wait_push(refused).nonfinite == 1
    assert [s.step for s in chief.status()] == [0, 0]
    # worker:0's push still waits for a second replica; worker:1 finishing lets it make the step alone.
    workers[1].done()
    assert workers[0].wait_push(waiting).step == 1
    assert _steps_and_refusals(chief, worker_index=1) == [(1, 1, 1), (1, 1, 1)]


def test_a_nan_step_after_training_ended_is_dropped_not_counted(start_cluster):
    cluster = start_cluster(1)
    model = torch.nn.Linear(2, 1)
    placement = place(model.named_parameters(), 1)
    chief = cluster.admin(model, placement)
    init_servers(chief, SGD(lr=1.0), ApplyConfig(num_workers=1, max_steps=0))
    worker = cluster.client(model, placement)
    worker.begin_push(0)
    reply = worker.wait_push(worker.push(PushRequest(nonfinite_loss=True)))
    assert (reply.nonfinite, reply.stop) == (0, True)
    (status,) = chief.status()
    assert (status.stats["nonfinite"], status.stats["dropped_after_max_steps"]) == (0, 1)


def test_all_finite_is_exact_even_when_the_sum_of_finite_values_overflows():
    huge = torch.full((4,), 3e38)
    assert torch.isinf(huge.sum())
    assert all_finite([huge, torch.ones(3), torch.empty(0)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not all_finite([torch.ones(3), torch.tensor([1.0, bad])])
        assert not all_finite([huge, torch.tensor([bad])])
    assert all_finite([])
