"""A worker offers each PS on its machine a shared-memory lane (ps/lanes.py) for its gradients and parameters."""

from __future__ import annotations

import logging
import os

import torch

from shardflow.comm.errors import CommError
from shardflow.ps import protocol
from shardflow.ps.connection import PSConnection
from shardflow.ps.lanes import LaneError, WorkerLane

log = logging.getLogger(__name__)


def offer_lanes(connection: PSConnection, worker_index: int) -> list[WorkerLane | None]:
    """Per PS, the lane it took, or None: offered to each PS that this process reaches over a UNIX socket (so on this
    machine) and holds dense variables. A PS that cannot map it, or a lane that cannot be made, leaves that PS on
    the socket, said in one line."""
    role = f"worker:{worker_index}"
    lanes: list[WorkerLane | None] = [None] * len(connection.peers)
    requests: dict[int, tuple[WorkerLane, int]] = {}
    for ps, peer in enumerate(connection.peers):
        if not connection.client.address(peer).startswith("ipc://"):
            continue
        buffers = [(getattr(torch, dtype), numel) for dtype, numel in connection.placement.buffer_sizes(ps).items()]
        if not any(numel for _, numel in buffers):
            continue
        try:
            lane = WorkerLane(buffers)
        except LaneError as error:
            log.warning("%s cannot make a shared-memory lane to %s (%s); it uses the socket", role, peer, error)
            continue
        attach = protocol.Attach(
            worker_index=worker_index,
            pid=os.getpid(),
            fd=lane.fd,
            push_slots=lane.push_slots,
            reply_slots=lane.reply_slots,
        )
        requests[ps] = lane, connection.client.send(peer, attach.header())
    closed: set[int] = set()
    try:
        for ps, (lane, seq) in requests.items():
            try:
                connection.recv(connection.peers[ps], seq)
            except CommError as error:
                log.warning("%s: %s; it uses the socket", role, error)
                lane.close()
                closed.add(ps)
                continue
            lanes[ps] = lane
    except BaseException:  # a PS restarted meanwhile (PSRestored once restored): no lane of this offer is used
        for ps, (lane, _) in requests.items():
            if ps not in closed:
                lane.close()
        raise
    return lanes
