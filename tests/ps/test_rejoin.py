"""A worker that dies while pushing may reach some PS with its last steps and not others. Restarted, it asks every
PS what it has (`rejoin`), resumes its input after the last step all PS have, and repeats the steps only some had:
each PS takes every step of every worker exactly once, and all PS end at the same global step."""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable

import pytest
import torch

from shardflow.comm.errors import CommError
from shardflow.ps import protocol
from shardflow.ps.client import ParameterClient, PushRequest
from shardflow.ps.optimizers import SGD
from shardflow.ps.placement import Placement, place
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import fetch_state, init_servers

from .conftest import Cluster


def _model() -> torch.nn.Module:
    # Two layers without bias: on 2 PS, each PS holds one.
    return torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))


def _step(client: ParameterClient, model: torch.nn.Module, consumed: int) -> protocol.StepReply:
    """One worker step whose gradient is all ones, pushed to every PS with the input position after it."""
    client.begin_push(0)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    return client.wait_push(client.push(PushRequest(input_state={"consumed": consumed})))


def _start(cluster: Cluster, mode: str, num_workers: int = 1) -> tuple[torch.nn.Module, Placement]:
    model = _model()
    placement = place(model.named_parameters(), 2)
    assert sorted(p.ps for p in placement.pieces) == [0, 1]
    init_servers(cluster.admin(model, placement), SGD(lr=1.0), ApplyConfig(mode=mode, num_workers=num_workers))
    return model, placement


def test_a_worker_that_died_mid_push_repeats_only_what_each_ps_missed(start_cluster):
    cluster = start_cluster(2)
    model, placement = _start(cluster, "async")
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    first = cluster.client(model, placement)
    first.pull()
    assert first.rejoin().local_step == 0  # a first start: nothing to resume
    for consumed in (1, 2, 3):
        _step(first, model, consumed)
    # Step 4 reaches ps:0 only: the worker dies before its push to ps:1 leaves.
    first.local_step += 1
    header = protocol.Push(
        worker_index=0, local_step=4, base_step=3, frame_counts=(1,), input_state={"consumed": 4}
    ).header()
    layer = placement.on_ps(0)[0]
    first.client.request("ps:0", header, [torch.ones(layer.numel)], timeout_s=5)
    assert [s.step for s in cluster.admin(model, placement).status()] == [4, 3]

    fresh = _model()
    restarted = cluster.client(fresh, placement)
    rejoined = restarted.rejoin()
    assert (rejoined.local_step, rejoined.input_state, rejoined.ahead) == (3, {"consumed": 3}, 1)
    restarted.pull()
    reply = _step(restarted, fresh, 4)  # step 4 again: ps:0 had it and answers, ps:1 applies it
    assert reply.step == 4
    _step(restarted, fresh, 5)
    status = cluster.admin(model, placement).status()
    assert [s.step for s in status] == [5, 5]
    assert [s.stats["repeated"] for s in status] == [1, 0]
    # Every PS applied each of the 5 steps once: SGD with lr 1 and gradients of ones moved each weight by -5.
    for name, value in fetch_state(restarted).params.items():
        assert torch.allclose(value, initial[name] - 5), name


def test_sync_waits_for_the_restarted_worker_and_completes_the_step_it_died_in(start_cluster):
    cluster = start_cluster(2)
    model, placement = _start(cluster, "sync", num_workers=2)
    survivor_model = _model()
    survivor = cluster.client(survivor_model, placement, worker_index=0)
    dying = cluster.client(model, placement, worker_index=1)
    for client in (survivor, dying):
        client.rejoin()
        client.pull()
    # Worker 1 pushes step 1 to ps:0 only, and dies; worker 0 pushes to both and waits for ps:1's update.
    layer = placement.on_ps(0)[0]
    header = protocol.Push(worker_index=1, local_step=1, base_step=0, frame_counts=(1,)).header()
    dying.client.send("ps:0", header, [torch.ones(layer.numel)])  # answered once step 0 is applied
    survivor.begin_push(0)
    for param in survivor_model.parameters():
        param.grad = torch.ones_like(param)
    waiting = survivor.push(PushRequest())

    restarted_model = _model()
    restarted = cluster.client(restarted_model, placement, worker_index=1)
    assert (restarted.rejoin().local_step, restarted.local_step) == (0, 0)
    restarted.pull()
    reply = _step(restarted, restarted_model, 1)  # ps:0 had it; ps:1 completes step 0 with it
    assert reply.step == 1
    assert survivor.wait_push(waiting).step == 1
    status = cluster.admin(model, placement).status()
    assert [s.step for s in status] == [1, 1]
    assert [s.stats["repeated"] for s in status] == [1, 0]


def test_sync_completes_a_step_without_a_lost_worker_and_counts_it_again_once_it_rejoins(start_cluster):
    cluster = start_cluster(2)
    model, placement = _start(cluster, "sync", num_workers=2)
    chief = cluster.admin(_model(), placement)
    survivor = cluster.client(model, placement, worker_index=0)
    survivor.rejoin()
    survivor.pull()
    # Worker 1 never pushes; once the chief says it is lost, worker 0's step is applied alone.
    survivor.begin_push(0)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    waiting = survivor.push(PushRequest())
    chief.lost(1)
    assert survivor.wait_push(waiting).step == 1
    # Back: a step needs both again.
    returning_model = _model()
    returning = cluster.client(returning_model, placement, worker_index=1)
    assert returning.rejoin().local_step == 0
    returning.pull()
    survivor.begin_push(1)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    waiting = survivor.push(PushRequest())
    assert [s.step for s in chief.status()] == [1, 1]  # held for worker 1
    assert _step(returning, returning_model, 1).step == 2
    assert survivor.wait_push(waiting).step == 2


def test_after_a_restore_a_ps_refuses_the_pushes_of_a_worker_until_it_rejoins(start_cluster):
    cluster = start_cluster(2)
    model, placement = _start(cluster, "async")
    worker = cluster.client(model, placement)
    worker.rejoin()
    worker.pull()
    _step(worker, model, 1)
    # A PS was lost: the chief restores every PS (generation 1); the worker's next push is of the training before.
    chief = cluster.admin(_model(), placement)
    init_servers(chief, SGD(lr=1.0), ApplyConfig(num_workers=1), generation=1)
    with pytest.raises(CommError, match="restored from a checkpoint after one was lost"):
        _step(worker, model, 2)
    assert [s.step for s in chief.status()] == [0, 0]
    rejoined = worker.rejoin()
    assert (rejoined.generation, rejoined.local_step) == (1, 0)
    worker.pull()
    assert _step(worker, model, 1).step == 1


def _ones(model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.grad = torch.ones_like(param)


def _sync_pair(cluster: Cluster) -> tuple[torch.nn.Module, Placement, dict[str, torch.Tensor], list[ParameterClient]]:
    """A sync job of 2 workers on 2 PS, both workers started; the initial parameters."""
    model, placement = _start(cluster, "sync", num_workers=2)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    workers = [cluster.client(_model(), placement, worker_index=index) for index in range(2)]
    for worker in workers:
        worker.rejoin()
        worker.pull()
    return model, placement, initial, workers


def _together(call: Callable[[], protocol.StepReply], other: ParameterClient, step: int) -> None:
    """`call` (a request of the restarted worker 0, on a thread of its own) and worker 1's step `step`, which
    completes global step `step`: both answered with it."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(call)
        assert _step(other, other.model, step).step == step
        assert waiting.result(timeout=30).step == step


def _moved_by_two_steps(client: ParameterClient, initial: dict[str, torch.Tensor]) -> None:
    # Each step the mean of one gradient of ones from each worker: SGD with lr 1 moved each weight by -2.
    for name, value in fetch_state(client).params.items():
        assert torch.allclose(value, initial[name] - 2), name


def test_sync_a_worker_restarted_while_its_step_waits_in_the_sum_computes_its_next_on_that_update(start_cluster):
    # A sum takes one push of each worker: the restarted worker's next step must not join the sum its last one is in
    # (it would make a global step of two of its own batches, and the job one step too many).
    cluster = start_cluster(2)
    model, placement, initial, (dying, other) = _sync_pair(cluster)
    dying.begin_push(0)
    _ones(dying.model)
    dying.push(PushRequest(input_state={"consumed": 1}))  # both PS sum it and wait for worker 1; then it dies
    status = cluster.admin(model, placement).status()
    assert [s.step for s in status] == [0, 0]

    restarted_model = _model()
    restarted = cluster.client(restarted_model, placement, worker_index=0)
    rejoined = restarted.rejoin()
    assert (rejoined.local_step, rejoined.ahead, rejoined.input_state) == (1, 0, {"consumed": 1})
    _together(restarted.pull, other, 1)  # its pull waits for the update that holds its step 1
    _together(functools.partial(_step, restarted, restarted_model, 2), other, 2)
    status = cluster.admin(model, placement).status()
    assert [(s.step, s.stats["applied"]) for s in status] == [(2, 2), (2, 2)]
    _moved_by_two_steps(restarted, initial)


def test_sync_a_restarted_worker_repeats_a_step_one_ps_sums_and_gets_its_reply_with_the_update(start_cluster):
    cluster = start_cluster(2)
    model, placement, initial, (dying, other) = _sync_pair(cluster)
    # Worker 0's step 1 reaches ps:0 only, which sums it and waits for worker 1; then worker 0 dies.
    layer = placement.on_ps(0)[0]
    header = protocol.Push(worker_index=0, local_step=1, base_step=0, frame_counts=(1,)).header()
    dying.client.send("ps:0", header, [torch.ones(layer.numel)])

    restarted_model = _model()
    restarted = cluster.client(restarted_model, placement, worker_index=0)
    assert (restarted.rejoin().local_step, restarted.local_step) == (0, 0)
    assert restarted.pull().step == 0
    # Its repeat of step 1: ps:1 sums it, ps:0 (which had it) answers with the update, as it would have.
    for local_step in (1, 2):
        _together(functools.partial(_step, restarted, restarted_model, local_step), other, local_step)
    status = cluster.admin(model, placement).status()
    assert [(s.step, s.stats["applied"], s.stats["repeated"]) for s in status] == [(2, 2, 1), (2, 2, 0)]
    _moved_by_two_steps(restarted, initial)


def test_sync_refuses_a_second_push_of_one_worker_into_one_sum(start_cluster):
    cluster = start_cluster(2)
    model, placement, _, (worker, _) = _sync_pair(cluster)
    layer = placement.on_ps(0)[0]
    for local_step, outcome in ((1, None), (2, "a second push of worker:0 for global step 1")):
        header = protocol.Push(worker_index=0, local_step=local_step, base_step=0, frame_counts=(1,)).header()
        if outcome is None:
            worker.client.send("ps:0", header, [torch.ones(layer.numel)])
            continue
        with pytest.raises(CommError, match=outcome):
            worker.client.request("ps:0", header, [torch.ones(layer.numel)], timeout_s=5)
    assert [s.step for s in cluster.admin(model, placement).status()] == [0, 0]
