"""The workers' requests a PS holds back, unanswered and not applied, in arrival order: pushes while its snapshots
wait for the chief to save them (state.Snapshots.full), and pushes and Done while the chief ends training at one
global step on every PS (between protocol `Hold` and `Stop`, see ps/admin.py `PSAdmin.stop`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from shardflow.comm.server import Request
from shardflow.ps import protocol
from shardflow.ps.update_rules import Refused


class Received(NamedTuple):
    """A worker's request with its decoded message: what a PS holds (here, or in its update rule: a push, pull or
    lookup) until it is answered."""

    request: Request
    message: protocol.Push | protocol.NonFinite | protocol.Pull | protocol.Lookup


Held = tuple[Request, protocol.Push | protocol.NonFinite | protocol.Done]


class Deferred:
    def __init__(self) -> None:
        self.requests: list[Held] = []
        self.holding = False
        """Between the chief's `Hold` and its `Stop`: no push is applied, so this PS's step stays where it said."""

    def waits(self, message: protocol.PSRequest, snapshots_full: bool) -> bool:
        """Whether `message` is to be held: a push while the snapshots are full, a push or Done while holding."""
        if self.holding:
            return isinstance(message, protocol.Push | protocol.NonFinite | protocol.Done)
        return snapshots_full and isinstance(message, protocol.Push | protocol.NonFinite)

    def add(self, held: Held, limit: int) -> None:
        """Hold one more; Refused once `limit` are held (ApplyConfig.max_held_requests)."""
        if len(self.requests) >= limit:
            why = "to say at which step training ends" if self.holding else "to save this PS's snapshots"
            raise Refused(
                f"{len(self.requests)} pushes wait already for the chief {why}, the most a PS holds "
                "(ApplyConfig.max_held_requests)"
            )
        self.requests.append(held)

    def clear(self) -> None:
        """Those held belong to the training before a restore: their workers have moved on."""
        self.requests = []
        self.holding = False

    def release(self, snapshots_full: Callable[[], bool]) -> Iterator[Held]:
        """The held requests to handle now, oldest first, while nothing holds them back (handling one may fill the
        snapshots again)."""
        while self.requests and not self.holding and not snapshots_full():
            yield self.requests.pop(0)
