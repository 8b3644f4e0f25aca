"""The all-reduce workers' group as it is formed again after a loss: which generation a restarted worker joins, and
a collective that waits for a worker restarted meanwhile, given up (a real gloo group of two ranks in threads,
formed through a real control service)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardflow as sf
from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.cluster.spec import ClusterSpec, TaskSpec
from shardflow.train import allreduce_group
from shardflow.train.job_keys import RejoinState
from shardflow.train.role_context import RoleContext


def _role(plane: ControlPlane, index: int) -> RoleContext:
    return RoleContext(spec=ClusterSpec.local(num_workers=2, num_ps=0), task=TaskSpec("worker", index), control=plane)


def test_a_worker_joins_generation_0_at_the_start_and_the_one_after_its_last_once_restarted(plane):
    role = _role(plane, 1)
    assert allreduce_group.generation_to_join(role) == 0
    plane.set(control_keys.allreduce_joined("worker:1"), "2")
    assert allreduce_group.generation_to_join(role) == 3


def _in_threads(plane: ControlPlane, work: Callable[[int, ControlPlane], Any]) -> dict[int, Any]:
    """`work(index, plane)` of each rank at once, each on a connection of its own as each worker process has: a held
    wait of one rank on a shared connection would hold back the other's keys (a group's connect could time out)."""
    planes = [plane, ControlPlane(plane.address, timeout_s=5)]
    results: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: work(i, planes[i])})) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    planes[1].close()
    return results


def _formed(plane: ControlPlane, generation: int = 0) -> dict[int, Any]:
    strategy = sf.AllReduceStrategy(num_workers=2, request_timeout_s=5)
    return _in_threads(plane, lambda i, p: allreduce_group.form(strategy, _role(p, i), generation, 1e18))


def test_a_collective_waiting_for_a_worker_restarted_meanwhile_is_given_up_naming_it(plane):
    groups = _formed(plane)
    plane.set(control_keys.heartbeat("worker:1"), "111:5")
    peers = allreduce_group.Peers(_role(plane, 0), heartbeat_timeout_s=30, generation=0)
    work = groups[0].allreduce([torch.ones(4)])  # worker:1 never takes part
    plane.set(control_keys.heartbeat("worker:1"), "222:0")  # its process is another: it was restarted
    with pytest.raises(allreduce_group.PeerLostError, match="worker:1 lost"):
        peers.wait(work)


def test_a_collective_is_given_up_once_the_other_worker_forms_a_later_generation(plane):
    """A slow worker (stopped past the heartbeat deadline, then woken) that the others took for lost: they form the
    next generation, alive, and it gives up its collective at once rather than at gloo's deadline."""
    groups = _formed(plane)
    plane.set(control_keys.heartbeat("worker:1"), "111:5")
    peers = allreduce_group.Peers(_role(plane, 0), heartbeat_timeout_s=30, generation=0)
    work = groups[0].allreduce([torch.ones(4)])  # worker:1 never takes part
    plane.set(control_keys.allreduce_joined("worker:1"), "1")
    with pytest.raises(allreduce_group.PeerLostError, match=r"worker:1 \(forming generation 1\)"):
        peers.wait(work)


def _run(step: int) -> RejoinState:
    return RejoinState(
        step=step,
        scalars={},
        hand_overs=0,
        hand_over_step=-1,
        hand_over_saves=False,
        batches_applied=[step, step],
        had_batch=[True, True],
    )


def test_a_survivor_one_step_behind_takes_the_state_of_the_one_that_applied_the_step(plane):
    """Worker:1 completed the collective of step 4 and applied it; worker:0 gave the same collective up (it took
    worker:1 for lost): in the next generation worker:0 takes worker:1's run and parameters."""
    groups = _formed(plane, generation=1)
    models = [torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    runs = _in_threads(
        plane,
        lambda i, p: allreduce_group.rejoin(groups[i], _role(p, i), _run(4 + i), models[i], optimizers[i]),
    )
    assert runs[0].step == runs[1].step == 5
    assert runs[0].batches_applied == [5, 5]
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))


def test_survivors_more_than_one_step_apart_fail_the_group_naming_the_steps(plane):
    groups = _formed(plane, generation=1)
    models = [torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]

    def rejoin(i: int, p: ControlPlane) -> Exception | None:
        try:
            allreduce_group.rejoin(groups[i], _role(p, i), _run(4 + 2 * i), models[i], optimizers[i])
        except allreduce_group.GroupLostError as error:
            return error
        return None

    errors = _in_threads(plane, rejoin)
    assert all("stopped at global steps [4, 6], more than one apart" in str(errors[i]) for i in range(2)), errors


class _GoneBack(Exception):
    """HybridStrategy's interrupt: a PS was lost, and every worker goes back to a checkpoint before forming."""


def test_a_rendezvous_with_a_worker_that_announced_the_generation_and_went_back_is_interrupted(plane):
    """worker:1 announced generation 1 and then went back (a PS was lost; or it died and its restart waits for the
    chief): worker:0 passes the announcements and waits in gloo's rendezvous for a rank that never comes. The
    interrupt ends that wait within seconds, not at request_timeout_s, and forming raises what it raised."""
    strategy = sf.AllReduceStrategy(num_workers=2, request_timeout_s=60)
    plane.set(control_keys.allreduce_joined("worker:1"), "1")
    calls: list[int] = []

    def interrupt() -> None:
        calls.append(1)
        if plane.is_set("test/recovery"):
            raise _GoneBack("ps:1 was lost")

    timer = threading.Timer(1.0, lambda: plane.set("test/recovery", "1"))
    timer.start()
    try:
        with pytest.raises(_GoneBack, match="ps:1 was lost"):
            allreduce_group.form(strategy, _role(plane, 0), 1, 1e18, interrupt=interrupt)
    finally:
        timer.cancel()
    assert calls


def test_forming_meets_a_recovery_begun_before_it_even_when_every_worker_announced_the_generation(plane):
    strategy = sf.AllReduceStrategy(num_workers=2, request_timeout_s=60)
    plane.set(control_keys.allreduce_joined("worker:1"), "3")

    def interrupt() -> None:
        raise _GoneBack("ps:0 was lost")

    with pytest.raises(_GoneBack):
        allreduce_group.form(strategy, _role(plane, 0), 3, 1e18, interrupt=interrupt)
    assert not plane.is_set("dist/workers/3/rank_0")  # no rendezvous began


def test_forming_gives_a_generation_up_once_another_worker_announced_a_later_one(plane):
    """worker:1 announced generation 1, and worker:0 waits in its rendezvous; restarted, worker:1 announces 2 and
    waits there for worker:0: worker:0 gives 1 up within seconds, naming the generation to meet it at."""
    strategy = sf.AllReduceStrategy(num_workers=2, request_timeout_s=60)
    plane.set(control_keys.allreduce_joined("worker:1"), "1")
    timer = threading.Timer(1.0, lambda: plane.set(control_keys.allreduce_joined("worker:1"), "2"))
    timer.start()
    try:
        with pytest.raises(allreduce_group.GenerationPassed, match="worker:1 generation 2") as passed:
            allreduce_group.form(strategy, _role(plane, 0), 1, 1e18)
    finally:
        timer.cancel()
    assert passed.value.generation == 2


def test_two_workers_announcing_different_generations_meet_at_the_later(plane):
    strategy = sf.AllReduceStrategy(num_workers=2, request_timeout_s=20)

    def form(index: int, p: ControlPlane) -> int:
        generation = {0: 1, 1: 4}[index]
        while True:
            try:
                allreduce_group.form(strategy, _role(p, index), generation, 1e18)
                return generation
            except allreduce_group.GenerationPassed as passed:
                generation = passed.generation

    assert _in_threads(plane, form) == {0: 4, 1: 4}
