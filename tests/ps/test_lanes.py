"""Shared-memory lanes between a worker and a PS of one machine: what one side writes the other reads, a PS maps
only a sealed memfd of its own user of the right size, and a live PS serves pushes and replies through a lane as
through frames, refusing requests that name slots it does not have."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.comm.server import Server
from shardflow.ps import protocol
from shardflow.ps.client import PushRequest
from shardflow.ps.lanes import LaneError, WorkerLane, lane_bytes, open_lane
from shardflow.ps.optimizers import SGD
from shardflow.ps.placement import Partitioner, place
from shardflow.ps.server import ParameterServer
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import fetch_state, init_servers

BUFFERS = [(torch.float32, 5), (torch.int64, 3), (torch.bfloat16, 0)]


def test_what_the_worker_writes_into_a_slot_the_ps_reads_and_back() -> None:
    worker = WorkerLane(BUFFERS)
    ps = open_lane(os.getpid(), worker.fd, BUFFERS, worker.push_slots, worker.reply_slots)
    worker.push[1][0].copy_(torch.arange(5.0))
    worker.push[1][1].copy_(torch.tensor([7, 8, 9]))
    assert torch.equal(ps.push[1][0], torch.arange(5.0)) and torch.equal(ps.push[1][1], torch.tensor([7, 8, 9]))
    ps.reply[2][0].fill_(3.0)
    assert torch.equal(worker.reply[2][0], torch.full((5,), 3.0))
    # Slots do not overlap: the other slots are untouched.
    assert not worker.push[0][0].any() and not worker.reply[0][0].any() and not worker.reply[1][0].any()
    assert [view.numel() for view in ps.reply[0]] == [5, 3, 0]
    worker.close()


def test_a_worker_hands_out_each_free_slot_once_and_frees_the_one_its_parameters_left() -> None:
    lane = WorkerLane(BUFFERS, push_slots=2, reply_slots=3)
    assert {lane.take_push(), lane.take_push()} == {0, 1} and lane.take_push() is None
    first, second = lane.take_reply(), lane.take_reply()
    lane.loaded_from(first)
    lane.loaded_from(second)  # the parameters left `first`
    assert sorted(lane.free_reply) == sorted({0, 1, 2} - {second})
    lane.loaded_from(None)  # parameters of their own (a reply in frames): `second` is free too
    assert sorted(lane.free_reply) == [0, 1, 2]
    lane.close()


def test_the_ps_refuses_a_descriptor_that_is_not_a_memfd(tmp_path: Path) -> None:
    with open(tmp_path / "lane", "wb+") as file:
        file.truncate(lane_bytes(BUFFERS, 2, 3))
        with pytest.raises(LaneError, match=r"/proc/\d+/fd/\d+ is not a memfd"):
            open_lane(os.getpid(), file.fileno(), BUFFERS, 2, 3)


def test_the_ps_refuses_a_memfd_that_could_shrink_under_it() -> None:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, lane_bytes(BUFFERS, 2, 3))
        with pytest.raises(LaneError, match="is not sealed against shrinking"):
            open_lane(os.getpid(), fd, BUFFERS, 2, 3)
    finally:
        os.close(fd)


def test_the_ps_refuses_a_lane_of_another_size_than_its_slots_need() -> None:
    lane = WorkerLane(BUFFERS, push_slots=2, reply_slots=3)
    with pytest.raises(LaneError, match=f"holds {lane_bytes(BUFFERS, 2, 3)} bytes; 2\\+4 slots need"):
        open_lane(os.getpid(), lane.fd, BUFFERS, 2, 4)
    lane.close()


def test_the_ps_does_not_wait_on_a_descriptor_that_is_a_pipe() -> None:
    read_end, write_end = os.pipe()
    try:
        started = time.monotonic()
        with pytest.raises(LaneError, match="is not a memfd of this user"):
            open_lane(os.getpid(), read_end, BUFFERS, 2, 3)
        assert time.monotonic() - started < 5
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_ps_names_a_descriptor_it_cannot_open() -> None:
    with pytest.raises(LaneError, match=r"cannot open /proc/\d+/fd/1000000"):
        open_lane(os.getpid(), 1_000_000, BUFFERS, 2, 3)


# -- a live PS -------------------------------------------------------------------------------------------------

SENDER = "worker:0"


@pytest.fixture
def live_ps() -> Iterator[tuple[ParameterServer, Client]]:
    """A PS serving in a thread, initialised with one float32 buffer of 4 zeros, SGD lr 0.5, and a worker's client."""
    ps = ParameterServer(Server("tcp://127.0.0.1:0"), 0)
    stop = threading.Event()
    thread = threading.Thread(target=ps.serve, kwargs={"should_stop": stop.is_set, "poll_s": 0.05}, daemon=True)
    thread.start()
    client = Client(SENDER)
    client.connect("ps:0", ps.server.address)
    init = protocol.Init(
        dtypes=("float32",),
        num_tables=0,
        optimizer=SGD(lr=0.5),
        apply=ApplyConfig(num_workers=1),
        step=0,
        frame_counts=(1,),
    )
    client.request("ps:0", init.header(), [torch.zeros(4)], timeout_s=5)
    yield ps, client
    client.close()
    stop.set()
    thread.join(timeout=5)
    ps.server.close()


def _stats(client: Client) -> dict[str, float]:
    header, _ = client.request("ps:0", protocol.Status().header(), timeout_s=5)
    return protocol.StatusReply.decode(header, "ps:0").stats


def _attach(client: Client, lane: WorkerLane) -> None:
    attach = protocol.Attach(worker_index=0, pid=os.getpid(), fd=lane.fd, push_slots=2, reply_slots=3)
    client.request("ps:0", attach.header(), timeout_s=5)


def test_a_push_and_its_reply_through_a_lane_update_and_return_the_parameters_as_frames_do(live_ps) -> None:
    _, client = live_ps
    lane = WorkerLane([(torch.float32, 4)])
    _attach(client, lane)
    lane.push[1][0].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    push = protocol.Push(worker_index=0, local_step=1, base_step=0, frame_counts=(0,), slot=1, reply_slot=2)
    header, frames = client.request("ps:0", push.header(), timeout_s=5)
    reply = protocol.StepReply.decode(header, "push", "ps:0")
    assert (reply.step, reply.lane, frames) == (1, True, [])
    assert torch.equal(lane.reply[2][0], torch.tensor([-0.5, -1.0, -1.5, -2.0]))
    # The same parameters in frames, for a request that names no slot.
    header, frames = client.request("ps:0", protocol.Pull().header(), timeout_s=5)
    assert not protocol.StepReply.decode(header, "pull", "ps:0").lane and torch.equal(frames[0], lane.reply[2][0])
    assert _stats(client)["lane_pushes"] == 1
    lane.close()


def test_a_request_naming_a_slot_without_a_lane_is_refused_and_the_ps_serves_on(live_ps) -> None:
    _, client = live_ps
    with pytest.raises(CommError, match="reply_slot names a lane slot, but no lane is attached"):
        client.request("ps:0", protocol.Pull(reply_slot=0).header(), timeout_s=5)
    push = protocol.Push(worker_index=0, local_step=1, base_step=0, frame_counts=(0,), slot=0)
    with pytest.raises(CommError, match="slot names a lane slot, but no lane is attached"):
        client.request("ps:0", push.header(), timeout_s=5)
    stats = _stats(client)
    assert (stats["malformed"], stats["applied"]) == (2, 0)


def test_a_slot_beyond_the_lane_is_refused_naming_it(live_ps) -> None:
    _, client = live_ps
    lane = WorkerLane([(torch.float32, 4)])
    _attach(client, lane)
    with pytest.raises(CommError, match="reply_slot is 3, but the lane has 3 of them"):
        client.request("ps:0", protocol.Pull(reply_slot=3).header(), timeout_s=5)
    push = protocol.Push(worker_index=0, local_step=1, base_step=0, frame_counts=(0,), slot=2)
    with pytest.raises(CommError, match="slot is 2, but the lane has 2 of them"):
        client.request("ps:0", push.header(), timeout_s=5)
    assert _stats(client)["applied"] == 0
    lane.close()


def test_a_lane_the_ps_cannot_map_is_refused_with_the_reason_and_counted(live_ps, tmp_path: Path) -> None:
    _, client = live_ps
    with open(tmp_path / "not-a-lane", "wb+") as file:
        attach = protocol.Attach(worker_index=0, pid=os.getpid(), fd=file.fileno(), push_slots=2, reply_slots=3)
        refused = r"ps:0 cannot map the shared-memory lane of worker:0#\w+: /proc/\d+/fd/\d+ is not a memfd"
        with pytest.raises(CommError, match=refused):
            client.request("ps:0", attach.header(), timeout_s=5)
    assert _stats(client)["lanes_refused"] == 1
    # Nothing was attached: a slot is still refused.
    with pytest.raises(CommError, match="no lane is attached"):
        client.request("ps:0", protocol.Pull(reply_slot=0).header(), timeout_s=5)


def test_a_restarted_worker_s_lane_replaces_the_one_of_the_process_it_replaces(live_ps) -> None:
    ps, first = live_ps
    old, new = WorkerLane([(torch.float32, 4)]), WorkerLane([(torch.float32, 4)])
    _attach(first, old)
    restarted = Client(SENDER)  # a new process: a new sender id
    restarted.connect("ps:0", ps.server.address)
    _attach(restarted, new)
    # The PS thread has answered both: the first process's lane is gone, and its slots with it.
    assert list(ps.lanes) == [restarted.sender_id]
    with pytest.raises(CommError, match="no lane is attached"):
        first.request("ps:0", protocol.Pull(reply_slot=0).header(), timeout_s=5)
    header, _ = restarted.request("ps:0", protocol.Pull(reply_slot=0).header(), timeout_s=5)
    assert protocol.StepReply.decode(header, "pull", "ps:0").lane
    restarted.close()
    old.close()
    new.close()


def test_overlapped_steps_through_lanes_leave_every_slot_free_but_the_one_in_use(start_lane_cluster) -> None:
    cluster = start_lane_cluster(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    placement = place(model.named_parameters(), 2)
    chief = cluster.client(model, placement)
    init_servers(chief, SGD(lr=0.1), ApplyConfig(num_workers=1))
    worker = cluster.client(model, placement)
    assert all(lane is not None for lane in worker.lanes)
    worker.pull()
    in_flight = []
    for step in range(6):  # as the worker loop runs them: step t+1 computed while step t's push is in flight
        worker.begin_push(step)
        model(torch.full((2, 4), float(step))).sum().backward()
        in_flight.append(worker.push(PushRequest()))
        while len(in_flight) > 1:
            worker.wait_push(in_flight.pop(0))
    worker.wait_push(in_flight.pop(0))
    for lane in worker.lanes:
        assert lane is not None
        assert sorted(lane.free_push) == [0, 1]
        assert lane.loaded is not None and sorted([*lane.free_reply, lane.loaded]) == [0, 1, 2]
    # The model computes on what the PS hold: the parameters of the last reply are the PS's own.
    state = fetch_state(chief)
    assert state.step == 6
    for name, value in model.state_dict().items():
        assert torch.equal(state.params[name], value), name


def test_a_variable_cut_across_ps_loads_through_reused_reply_slots_as_the_ps_hold_it(start_lane_cluster) -> None:
    cluster = start_lane_cluster(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    placement = place(model.named_parameters(), 2, Partitioner(min_slice_bytes=4, fixed_shards=2))
    assert any(piece.partitioned for piece in placement.pieces)
    chief = cluster.client(model, placement)
    init_servers(chief, SGD(lr=0.1), ApplyConfig(num_workers=1))
    worker = cluster.client(model, placement)
    worker.pull()
    for step in range(5):  # more steps than reply slots: each slot is loaded from again
        worker.begin_push(step)
        model(torch.full((2, 4), float(step))).sum().backward()
        worker.wait_push(worker.push(PushRequest()))
    state = fetch_state(chief)
    for name, value in model.state_dict().items():
        assert torch.equal(state.params[name], value), name


def test_a_sender_that_attaches_as_two_workers_cannot_make_the_ps_fail_when_they_finish(live_ps) -> None:
    ps, client = live_ps
    ps.limits = protocol.Limits(num_workers=2, buffers=ps.limits.buffers, num_tables=0)  # a job of 2 workers
    lanes = [WorkerLane([(torch.float32, 4)]) for _ in range(2)]
    for worker_index, lane in enumerate(lanes):
        attach = protocol.Attach(worker_index=worker_index, pid=os.getpid(), fd=lane.fd, push_slots=2, reply_slots=3)
        client.request("ps:0", attach.header(), timeout_s=5)
    for worker_index in (0, 1):
        client.request("ps:0", protocol.Done(worker_index=worker_index).header(), timeout_s=5)
    assert ps.lanes == {} and _stats(client)["failed"] == 0
    for lane in lanes:
        lane.close()
