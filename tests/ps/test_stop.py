"""Ending training early on several PS (ps/admin.py `PSAdmin.stop`): async PS may be a push apart when the chief
decides, so each first holds the workers' pushes and says its step, then all end at the furthest one's. Real PS
on loopback sockets, a real worker's pushes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from shardflow.comm.errors import CommError
from shardflow.ps import protocol
from shardflow.ps.admin import PSAdmin
from shardflow.ps.client import ParameterClient, PushRequest
from shardflow.ps.optimizers import SGD
from shardflow.ps.placement import place
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import fetch_state, init_servers


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))


def _push(worker: ParameterClient, model: torch.nn.Module) -> protocol.StepReply:
    worker.begin_push(0)
    model(torch.ones(1, 2)).sum().backward()
    return worker.wait_push(worker.push(PushRequest()))


def _started(start_cluster, num_ps: int, num_workers: int = 1) -> tuple[Any, PSAdmin, ParameterClient, torch.nn.Module]:
    """`num_ps` PS initialised with the model (SGD, async), the chief's client to them and a worker's, and its model."""
    cluster = start_cluster(num_ps)
    model = _model()
    placement = place(model.named_parameters(), num_ps)
    assert {p.ps for p in placement.pieces} == set(range(num_ps))
    admin = cluster.admin(model, placement)
    init_servers(admin, SGD(lr=0.5), ApplyConfig(num_workers=num_workers))
    worker_model = _model()
    worker = cluster.client(worker_model, placement)
    worker.timeout_s = 60.0  # a held push waits for the test's next steps, however loaded the machine
    return cluster, admin, worker, worker_model


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_push_one_ps_applied_before_the_stop_is_applied_by_every_ps(start_cluster):
    cluster, admin, worker, worker_model = _started(start_cluster, 2, num_workers=2)
    # The race, made certain: ps:0 holds (as if the chief's Hold reached it first), ps:1 applies the push.
    admin.client.request("ps:0", protocol.Hold().header(), timeout_s=5)
    replies: list[protocol.StepReply] = []
    pushing = threading.Thread(target=lambda: replies.append(_push(worker, worker_model)))
    pushing.start()
    _wait(lambda: cluster.ps[1].step == 1 and len(cluster.ps[0].deferred.requests) == 1, "ps:1 applied, ps:0 held")
    assert cluster.ps[0].step == 0
    assert admin.stop() == 1  # the furthest PS's step: ps:0 applies the push it held
    pushing.join(60)
    assert [(r.step, r.stop) for r in replies] == [(1, True)]
    assert [ps.step for ps in cluster.ps] == [1, 1]
    after = _push(worker, worker_model)  # later pushes are dropped by every PS
    assert (after.step, after.stop) == (1, True)
    state = fetch_state(admin)
    assert state.step == 1 and [s["applied"] for s in state.stats.values()] == [1, 1]
    assert [s["dropped_after_max_steps"] for s in state.stats.values()] == [1, 1]


def test_a_stop_at_a_step_already_passed_ends_training_there_and_says_so(start_cluster):
    cluster, admin, worker, worker_model = _started(start_cluster, 1)
    _push(worker, worker_model)
    _push(worker, worker_model)
    with pytest.raises(CommError, match="training cannot end at global step 1: ps:0 is at 2"):
        admin.broadcast(protocol.Stop(step=1))
    after = _push(worker, worker_model)
    assert (after.step, after.stop, cluster.ps[0].updates.stats["dropped_after_max_steps"]) == (2, True, 1)


def test_a_hold_shows_in_the_status_until_a_snapshot_ends_it(start_cluster):
    _, admin, _, _ = _started(start_cluster, 2)
    admin.broadcast(protocol.Hold())
    assert [reply.holding for reply in admin.status()] == [True, True]
    assert admin.snapshot_at_furthest() == 0
    assert [(reply.holding, reply.stop, reply.snapshots) for reply in admin.status()] == [(False, False, (0,))] * 2


def test_a_snapshot_asked_for_while_the_ps_are_a_push_apart_is_of_one_step_on_every_ps(start_cluster):
    """Time-based checkpoints and evaluations: each PS holds the pushes, then all snapshot the furthest one's step,
    which none can have passed; the PS behind take it once their held pushes bring them there."""
    cluster, admin, worker, worker_model = _started(start_cluster, 2)
    _push(worker, worker_model)
    admin.client.request("ps:0", protocol.Hold().header(), timeout_s=5)
    replies: list[protocol.StepReply] = []
    pushing = threading.Thread(target=lambda: replies.append(_push(worker, worker_model)))
    pushing.start()
    _wait(lambda: cluster.ps[1].step == 2 and len(cluster.ps[0].deferred.requests) == 1, "ps:1 applied, ps:0 held")
    assert admin.snapshot_at_furthest() == 2
    pushing.join(60)
    assert [(r.step, r.stop) for r in replies] == [(2, False)]
    assert [(reply.snapshots, reply.holding) for reply in admin.status()] == [((2,), False), ((2,), False)]
