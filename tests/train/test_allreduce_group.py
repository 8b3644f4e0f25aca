"""The all-reduce workers' group as it is formed again after a loss: which generation a restarted worker joins, and
a collective that waits for a worker restarted meanwhile, given up (a real gloo group of two ranks in threads,
formed through a real control service)."""

from __future__ import annotations

import threading

import pytest
import torch

import shardflow as sf
from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.cluster.spec import ClusterSpec, TaskSpec
from shardflow.train import allreduce_group
from shardflow.train.role_context import RoleContext


def _role(plane: ControlPlane, index: int) -> RoleContext:
    return RoleContext(spec=ClusterSpec.local(num_workers=2, num_ps=0), task=TaskSpec("worker", index), control=plane)


def test_a_worker_joins_generation_0_at_the_start_and_the_one_after_its_last_once_restarted(plane):
    role = _role(plane, 1)
    assert allreduce_group.generation_to_join(role) == 0
    plane.set(control_keys.allreduce_joined("worker:1"), "2")
    assert allreduce_group.generation_to_join(role) == 3


def test_a_collective_waiting_for_a_worker_restarted_meanwhile_is_given_up_naming_it(plane):
    strategy = sf.AllReduceStrategy(num_workers=2, request_timeout_s=5)
    groups: dict[int, object] = {}
    # A connection of its own for each rank, as each worker process has: a held wait of one rank on a shared
    # connection would hold back the other's keys, and the group's connect could time out under load.
    planes = [plane, ControlPlane(plane.address, timeout_s=5)]
    formers = [
        threading.Thread(
            target=lambda i=i: groups.update({i: allreduce_group.form(strategy, _role(planes[i], i), 0, 1e18)})
        )
        for i in range(2)
    ]
    for former in formers:
        former.start()
    for former in formers:
        former.join()
    planes[1].close()
    plane.set(control_keys.heartbeat("worker:1"), "111:5")
    peers = allreduce_group.Peers(_role(plane, 0), heartbeat_timeout_s=30)
    work = groups[0].allreduce([torch.ones(4)])  # type: ignore[attr-defined]  # worker:1 never takes part
    plane.set(control_keys.heartbeat("worker:1"), "222:0")  # its process is another: it was restarted
    with pytest.raises(allreduce_group.PeerLostError, match="worker:1 lost"):
        peers.wait(work)
