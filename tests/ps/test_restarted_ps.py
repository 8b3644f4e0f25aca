"""A PS that was restarted holds nothing until the chief restores every PS: it answers whatever a worker asks with
`Unserved` (never an error, even for a lane slot of its previous process), and the worker waits for the restore."""

from __future__ import annotations

import pytest
import torch

from shardflow.comm.client import Client
from shardflow.ps import protocol
from shardflow.ps.client import ParameterClient
from shardflow.ps.connection import PSNotRestored
from shardflow.ps.placement import place

from .conftest import Cluster


class Restored(Exception):
    """What the worker's interrupt raises once the chief restored the PS (train/worker.py's PSRestored)."""


@pytest.fixture
def cluster():
    started = Cluster(1)
    yield started
    started.close()


def test_a_ps_not_restored_yet_answers_a_push_naming_a_lane_slot_unserved_not_malformed(cluster):
    client = Client("worker:0")
    client.connect("ps:0", cluster.addresses[0])
    push = protocol.Push(worker_index=0, local_step=3, base_step=2, frame_counts=(0,), slot=1, reply_slot=0)
    header, _ = client.request("ps:0", push.header(), timeout_s=5)
    assert protocol.Unserved.found_in(header, "ps:0") == protocol.Unserved(unserved=0)
    assert cluster.ps[0].stats["malformed"] == 0 and cluster.ps[0].step == 0
    client.close()


def test_a_worker_waits_for_the_restore_of_a_ps_that_answers_unserved(cluster):
    model = torch.nn.Linear(2, 1)
    checks: list[int] = []

    def interrupt() -> None:
        checks.append(len(checks))
        if len(checks) == 3:
            raise Restored

    params = ParameterClient(
        Client("worker:0"),
        cluster.addresses,
        place(model.named_parameters(), 1),
        model,
        timeout_s=5,
        worker_index=0,
        interrupt=interrupt,
    )
    with pytest.raises(Restored):
        params.pull()
    params.client.close()


def test_without_a_way_to_learn_of_the_restore_an_unserved_answer_is_an_error_naming_the_ps(cluster):
    model = torch.nn.Linear(2, 1)
    params = ParameterClient(
        Client("worker:0"), cluster.addresses, place(model.named_parameters(), 1), model, timeout_s=5, worker_index=0
    )
    with pytest.raises(PSNotRestored, match=r"ps:0 at .* was restarted and holds nothing yet"):
        params.rejoin()
    params.client.close()
