"""A real ParameterServer on a loopback socket, driven through ParameterClient."""

from __future__ import annotations

import typing

import torch

from shardflow.ps import protocol, server
from shardflow.ps.client import PushRequest
from shardflow.ps.optimizers import SGD, Adam
from shardflow.ps.placement import Partitioner, place
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import fetch_state, init_servers


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 3, 5))


def test_every_request_of_the_protocol_has_one_handler():
    assert set(server.HANDLERS) == set(typing.get_args(protocol.PSRequest))


def test_a_partitioned_tensor_round_trips_exactly(cluster):
    model = _model()
    placement = place(model.named_parameters(), 3, Partitioner(fixed_shards=3))
    assert sum(p.name == "0.weight" and p.partitioned for p in placement.pieces) == 3
    chief = cluster.client(model, placement)
    init_servers(chief, SGD(lr=0.1), ApplyConfig(num_workers=1))

    fresh = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 3, 5))
    worker = cluster.client(fresh, placement)
    worker.pull()
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_async_push_applies_sgd_on_the_ps_and_counts_one_step(cluster):
    model = _model()
    placement = place(model.named_parameters(), 3, Partitioner(fixed_shards=2))
    init_servers(cluster.client(model, placement), SGD(lr=0.5), ApplyConfig(num_workers=1))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    worker = cluster.client(model, placement)
    worker.begin_push(0)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None
        grads[name] = param.grad.clone()
    reply = worker.wait_push(worker.push(PushRequest()))
    assert reply.step == 1
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), before[name] - 0.5 * grads[name], rtol=0, atol=1e-6)
    assert worker.global_step() == 1
    # With lanes, every PS that holds dense variables had the gradients through its lane.
    lane_pushes = [s["lane_pushes"] for s in fetch_state(worker).stats.values() if s["applied"]]
    assert lane_pushes == [1 if cluster.lanes else 0] * len(lane_pushes) and lane_pushes


def test_an_early_push_goes_out_while_backward_runs_and_push_returns_it(cluster):
    model = _model()
    placement = place(model.named_parameters(), 3)
    init_servers(cluster.admin(model, placement), SGD(lr=0.5), ApplyConfig(num_workers=1))
    worker = cluster.client(model, placement)
    early = PushRequest(input_state={"batch": 1})
    worker.begin_push(0, early)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    assert worker.global_step() == 1  # applied before push() was called
    reply = worker.wait_push(worker.push(early))
    assert reply.step == 1
    assert worker.rejoin().input_state == {"batch": 1}


def test_adam_slots_live_on_the_ps_and_come_back_in_the_state(cluster):
    model = _model()
    placement = place(model.named_parameters(), 3)
    chief = cluster.client(model, placement)
    init_servers(chief, Adam(lr=1e-2), ApplyConfig(num_workers=1))
    worker = cluster.client(model, placement)
    worker.begin_push(0)
    model(torch.tensor([[4, 5, 6]])).sum().backward()
    worker.wait_push(worker.push(PushRequest()))
    stats = fetch_state(chief).stats
    assert all(s["applied"] == 1 for s in stats.values() if s["step"])


def test_sync_averages_replicas_and_drops_a_stale_gradient(cluster):
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    placement = place(model.named_parameters(), 3)
    init_servers(
        cluster.client(model, placement), SGD(lr=1.0), ApplyConfig(mode="sync", num_workers=3, replicas_to_aggregate=2)
    )
    workers = [cluster.client(torch.nn.Linear(2, 1, bias=False), placement, worker_index=i) for i in range(3)]
    for w in workers:
        w.pull()  # every worker computes on the parameters of step 0
    for i, w in enumerate(workers):
        w.begin_push(0)
        param = dict(w.named)["weight"]
        param.grad = torch.full_like(param, float(i + 1))
    # Worker 2 pushes once the first two were aggregated: each client has its own socket (or lane), so pushes sent
    # together may reach the PS in any order.
    requests = [w.push(PushRequest()) for w in workers[:2]]
    replies = [w.wait_push(r) for w, r in zip(workers[:2], requests, strict=True)]
    replies.append(workers[2].wait_push(workers[2].push(PushRequest())))
    # Workers 0 and 1 were aggregated: weight = 0 - mean(1, 2) = -1.5; worker 2 arrived late.
    assert [r.step for r in replies] == [1, 1, 1]
    for w in workers:
        assert torch.equal(dict(w.named)["weight"].detach(), torch.full((1, 2), -1.5))
    stats = fetch_state(workers[0]).stats
    owner = next(s for s in stats.values() if s["applied"])
    assert owner["dropped_stale"] == 1


def test_pushes_after_max_steps_are_dropped_and_counted(cluster):
    model = torch.nn.Linear(2, 2)
    placement = place(model.named_parameters(), 3)
    init_servers(cluster.client(model, placement), SGD(lr=0.1), ApplyConfig(num_workers=1, max_steps=2))
    worker = cluster.client(model, placement)
    replies = []
    for _ in range(3):
        worker.begin_push(0)
        model(torch.ones(1, 2)).sum().backward()
        replies.append(worker.wait_push(worker.push(PushRequest())))
    assert [(r.step, r.stop) for r in replies] == [(1, False), (2, True), (2, True)]
    stats = fetch_state(worker).stats
    assert stats["ps:0"]["dropped_after_max_steps"] == 1
