"""Shared-memory lanes: a worker and a PS of the same machine move the dense gradients and parameters through memory
both map, in place of the socket, which costs the kernel two copies of every byte (about 0.5 ms of CPU per 2.4 MB
round trip on loopback against 0.02 ms for a memcpy).

A lane is a sealed memfd the worker makes, one per PS, holding `push_slots` slots for gradients and `reply_slots`
for parameters, each one flat buffer per dtype as the PS holds them. The worker writes a step's gradients into a
free push slot and names it in its push; the PS writes the parameters of its reply into the reply slot the request
names. Each side only touches a slot the other is done with: a push slot is the PS's from the push until its reply,
a reply slot the worker's from the reply until its parameters are replaced by a later reply's. The PS opens the
memfd through /proc; the seals make sure nobody can shrink it under the PS's mapping (which would kill the PS with
SIGBUS on its next write), and the PS checks them, the owner and the size before it maps anything.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

PUSH_SLOTS = 2
"""A worker's pushes in flight: with overlap, step t's while it waits for the reply to step t-1's."""
REPLY_SLOTS = 3
"""The parameters in use, and the replies of two pushes in flight."""
MAX_SLOTS = 8
"""The most slots of either kind a PS maps for one lane."""
MAX_LANE_BYTES = 1 << 30
"""A worker uses a lane to a PS only when its slots fit in this; a bigger shard goes over the socket."""
_ALIGN = 64
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0

Buffers = Sequence[tuple[torch.dtype, int]]
"""A PS's dense buffers: each one's dtype and element count, in buffer order."""


class LaneError(ValueError):
    """A lane that cannot be made or mapped; says why."""


def lane_bytes(buffers: Buffers, push_slots: int, reply_slots: int) -> int:
    """The size of a lane with these slots for these buffers."""
    return (push_slots + reply_slots) * _slot_bytes(buffers)


def _slot_bytes(buffers: Buffers) -> int:
    return sum(_aligned(numel * dtype.itemsize) for dtype, numel in buffers)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Lane:
    """The slots of one lane as tensors over its mapping: `push[slot]` and `reply[slot]` each hold one flat tensor
    per buffer. The mapping lives as long as any of these tensors does."""

    def __init__(self, memory: mmap.mmap, buffers: Buffers, push_slots: int, reply_slots: int) -> None:
        self.push_slots, self.reply_slots = push_slots, reply_slots
        slots: list[list[torch.Tensor]] = []
        offset = 0
        for _ in range(push_slots + reply_slots):
            views = []
            for dtype, numel in buffers:
                if numel:
                    views.append(torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset))
                else:  # torch.frombuffer refuses an empty view
                    views.append(torch.empty(0, dtype=dtype))
                offset += _aligned(numel * dtype.itemsize)
            slots.append(views)
        self.push = slots[:push_slots]
        self.reply = slots[push_slots:]


class WorkerLane(Lane):
    """The worker's side: it makes the memfd and keeps it open while the lane is in use, and keeps which slots are
    free. A slot whose request was abandoned is never handed out again: its reply may still come."""

    def __init__(self, buffers: Buffers, push_slots: int = PUSH_SLOTS, reply_slots: int = REPLY_SLOTS) -> None:
        size = lane_bytes(buffers, push_slots, reply_slots)
        if not hasattr(os, "memfd_create") or not _SEALS:
            raise LaneError("this system has no sealed memfds")
        if size > MAX_LANE_BYTES:
            raise LaneError(f"its {size >> 20} MiB would be more than the {MAX_LANE_BYTES >> 20} MiB a lane may have")
        fd = os.memfd_create("shardflow-lane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # the memory now, or an error now: never SIGBUS on a later write
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            memory = mmap.mmap(fd, size)
        except OSError as error:
            os.close(fd)
            raise LaneError(f"cannot make a {size >> 20} MiB memfd: {error}") from error
        super().__init__(memory, buffers, push_slots, reply_slots)
        self.fd = fd
        self.free_push = list(range(push_slots))
        self.free_reply = list(range(reply_slots))
        self.loaded: int | None = None
        """The reply slot the model's parameters point into, if any."""

    def take_push(self) -> int | None:
        return self.free_push.pop() if self.free_push else None

    def take_reply(self) -> int | None:
        return self.free_reply.pop() if self.free_reply else None

    def give_back_push(self, slot: int | None) -> None:
        if slot is not None:
            self.free_push.append(slot)

    def give_back_reply(self, slot: int | None) -> None:
        if slot is not None:
            self.free_reply.append(slot)

    def loaded_from(self, slot: int | None) -> None:
        """The parameters now point into reply slot `slot` (None: into memory of their own); the one they pointed
        into before is free."""
        if self.loaded != slot:
            self.give_back_reply(self.loaded)
        self.loaded = slot

    def close(self) -> None:
        """Close the memfd; the memory goes once neither side maps it."""
        os.close(self.fd)


def open_lane(pid: int, fd: int, buffers: Buffers, push_slots: int, reply_slots: int) -> Lane:
    """The PS's side: map the lane that process `pid` holds as file descriptor `fd`, once it is a memfd of this
    user that nobody can shrink, of the size these slots need. LaneError says what is wrong."""
    path = f"/proc/{pid}/fd/{fd}"
    size = lane_bytes(buffers, push_slots, reply_slots)
    not_ours = f"{path} is not a memfd of this user"
    try:
        # Looked at before it is opened: opening a device or a FIFO can do something, or wait.
        if not _regular_and_ours(os.stat(path)):
            raise LaneError(not_ours)
        handle = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as error:
        raise LaneError(f"cannot open {path}: {error.strerror}") from None
    try:
        info = os.fstat(handle)
        if not _regular_and_ours(info):  # what was opened, should the descriptor have changed meanwhile
            raise LaneError(not_ours)
        try:
            seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
        except OSError:
            raise LaneError(f"{path} is not a memfd") from None
        if seals & _SEALS != _SEALS:
            raise LaneError(f"{path} is not sealed against shrinking (seals {seals:#x})")
        if info.st_size != size:
            raise LaneError(f"{path} holds {info.st_size} bytes; {push_slots}+{reply_slots} slots need {size}")
        memory = mmap.mmap(handle, size)
    finally:
        os.close(handle)
    return Lane(memory, buffers, push_slots, reply_slots)


class AttachedLanes(dict[str, Lane]):
    """A PS's lanes to the workers of its machine, by sender: at most one per worker (a restarted worker's replaces
    the lane of the process it replaces, whose memory goes once nothing of the PS uses it)."""

    def __init__(self) -> None:
        super().__init__()
        self._senders: dict[int, str] = {}

    def attach(self, worker_index: int, sender: str, lane: Lane) -> None:
        self.drop(worker_index)
        self[sender] = lane
        self._senders[worker_index] = sender

    def open(self, worker_index: int, sender: str, pid: int, fd: int, buffers: Buffers, slots: tuple[int, int]) -> None:
        """Map and attach the lane of `sender` (its memfd `fd` in process `pid`) with (push, reply) `slots`, one flat
        buffer each per dense buffer of this PS; LaneError says why it cannot."""
        if not any(numel for _, numel in buffers):
            raise LaneError("it holds no dense variables")
        self.attach(worker_index, sender, open_lane(pid, fd, buffers, *slots))

    def drop(self, worker_index: int) -> None:
        sender = self._senders.pop(worker_index, None)
        if sender is not None:
            self.pop(sender, None)  # gone already if that sender attached again as another worker

    def slot_problem(self, sender: str, slot: int | None, reply_slot: int | None) -> tuple[str, str] | None:
        """What is wrong with the lane slots a request of `sender` names, as (field, problem), or None."""
        lane = self.get(sender)
        for name, value, limit in (("slot", slot, "push_slots"), ("reply_slot", reply_slot, "reply_slots")):
            if value is None:
                continue
            if lane is None:
                return name, "names a lane slot, but no lane is attached"
            if value >= getattr(lane, limit):
                return name, f"is {value}, but the lane has {getattr(lane, limit)} of them"
        return None


def _regular_and_ours(info: os.stat_result) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
