"""What an all-reduce worker puts again on a restarted chief's control service (train/allreduce_replay.py): a new
service on the chief's address starts empty but for the new chief's id, which the worker's replay finds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.cluster.spec import ClusterSpec, TaskSpec
from shardflow.comm.errors import CommError
from shardflow.train import allreduce_state, job_keys
from shardflow.train.allreduce_replay import Replay
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.job_keys import AllReduceStart, InputState
from shardflow.train.role_context import RoleContext


@pytest.fixture
def worker_0(plane: ControlPlane) -> Iterator[tuple[Replay, RoleContext]]:
    spec = ClusterSpec.local(num_workers=2, num_ps=0)
    plane.set(control_keys.ALLREDUCE_CHIEF, "first")
    role = RoleContext(spec=spec, task=TaskSpec("worker", 0), control=ControlPlane(plane.address, timeout_s=10))
    replay = Replay(role)
    yield replay, role
    replay.stop()
    role.control.close()


def _restart_chief(plane: ControlPlane) -> ControlPlane:
    """The chief's control service gone and a new, empty one on its address; the new chief's connection to it."""
    plane.close()
    # A socket closes in ZeroMQ's I/O thread, after close() returns: the port is free a moment later. (A chief
    # restarted for real is a new process, whose old one the kernel closed.)
    deadline = time.monotonic() + 5
    while True:
        try:
            chief = ControlPlane.serve(plane.address, timeout_s=10)
            break
        except CommError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    chief.set(control_keys.ALLREDUCE_CHIEF, "restarted")
    return chief


def _hand_over(replay: Replay, n: int) -> ModelState:
    state = ModelState(step=10 * n, params={"w": torch.arange(4.0) + n})
    replay.put_position(n, InputState(position={"batch": n}))
    replay.send_state(n, state, checkpoint=True, final=False)
    return state


def test_a_restarted_chief_gets_the_start_the_generation_and_the_unsaved_hand_over_again(plane, worker_0):
    replay, _ = worker_0
    replay.keep(job_keys.ALLREDUCE_START, AllReduceStart(step=5, checkpoint=None))
    replay.set_joined(2)
    replay.mark_joined()
    state = _hand_over(replay, 1)
    chief = _restart_chief(plane)
    try:
        live = chief.read(job_keys.allreduce_live("worker:0"), waiting_for="worker:0's replay", timeout_s=10)
        assert (live.chief, live.joined, live.next_hand_over) == ("restarted", True, 1)
        assert chief.read(job_keys.ALLREDUCE_START, waiting_for="the start").step == 5
        assert chief.get(control_keys.allreduce_joined("worker:0"), waiting_for="the generation") == "2"
        notice = chief.read(job_keys.allreduce_checkpoint(1), waiting_for="the notice")
        again = allreduce_state.receive(
            chief, "checkpoint/1", notice.num_chunks, step=notice.step, scalars={}, waiting_for="chunks", delete=True
        )
        assert torch.equal(again.params["w"], state.params["w"])
        position = chief.read(job_keys.allreduce_position(1, "worker:0"), waiting_for="the position")
        assert position.position == {"batch": 1}
    finally:
        chief.close()


def test_a_hand_over_the_chief_confirmed_saved_is_not_put_again(plane, worker_0):
    replay, _ = worker_0
    replay.mark_joined()
    for n in (1, 2, 3):
        _hand_over(replay, n)
        if n < 3:
            replay.confirmed(n)
    chief = _restart_chief(plane)
    try:
        live = chief.read(job_keys.allreduce_live("worker:0"), waiting_for="worker:0's replay", timeout_s=10)
        assert live.next_hand_over == 3
        assert not chief.is_set(job_keys.allreduce_checkpoint(2))
        assert chief.is_set(job_keys.allreduce_checkpoint(3))
        # Positions of the last two hand-overs only: the one before them is handled for sure.
        assert not chief.is_set(job_keys.allreduce_position(1, "worker:0"))
        assert chief.is_set(job_keys.allreduce_position(2, "worker:0"))
    finally:
        chief.close()


def test_a_chief_restarted_amid_a_streamed_state_gets_it_whole_from_its_start(plane, worker_0, monkeypatch):
    replay, _ = worker_0
    replay.mark_joined()
    monkeypatch.setattr(allreduce_state, "CHUNK_BYTES", 4096)
    state = ModelState(step=7, params={"w": torch.arange(1024.0 * 3 * allreduce_state.WINDOW)})
    sender = threading.Thread(target=replay.send_state, args=(1, state), kwargs={"checkpoint": True, "final": True})
    sender.start()
    last = control_keys.state_chunk("checkpoint/1", allreduce_state.WINDOW - 1)
    plane.wait([last], waiting_for="the window's last chunk")  # the sender waits for the chief to read
    chief = _restart_chief(plane)
    try:
        chief.read(job_keys.allreduce_live("worker:0"), waiting_for="worker:0's replay", timeout_s=10)
        notice = chief.read(job_keys.allreduce_checkpoint(1), waiting_for="the notice")
        again = allreduce_state.receive(
            chief, "checkpoint/1", notice.num_chunks, step=7, scalars={}, waiting_for="chunks", delete=True
        )
        sender.join()
        assert torch.equal(again.params["w"], state.params["w"])
    finally:
        replay.stop()  # before the service it talks to goes: else its last call waits out its 10 s deadline
        chief.close()
