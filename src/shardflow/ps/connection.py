"""A connection to every PS for one model: the peers, the model's variables and how they are placed, requests sent
to all PS at once, and waits for replies that end early once the PS were restored. The worker's client
(ps/client.py) and the chief's (ps/admin.py) are built on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError, DeadlineExceeded
from shardflow.ps import protocol
from shardflow.ps.layout import ShardLayout
from shardflow.ps.placement import Placement
from shardflow.ps.protocol import StatusReply, StepReply, Unserved

# How often a wait longer than this checks whether the PS were restored meanwhile.
_RESTORE_CHECK_S = 0.5


class PSNotRestored(CommError):
    """A PS answered `Unserved` (it was restarted and holds nothing) and the chief did not restore it in time."""


def read_global_step(client: Client, peer: str, timeout_s: float) -> int:
    """The global step as `peer` (a PS, connected to `client`) counts it now."""
    header, _ = client.request(peer, protocol.Status().header(), timeout_s=timeout_s)
    return StatusReply.decode(header, peer).step


class PSConnection:
    """Talks to every PS about one model's variables, placed by `placement`."""

    def __init__(
        self,
        client: Client,
        ps_endpoints: Sequence[str],
        placement: Placement,
        model: torch.nn.Module,
        *,
        timeout_s: float = 60.0,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        """`interrupt` is called between slices of a wait for a reply, and when a PS refuses a request: it raises
        once the PS were restarted or restored, since a lost PS never answers (see `recv`)."""
        if len(ps_endpoints) != placement.num_ps:
            raise ValueError(f"placement is for {placement.num_ps} PS but {len(ps_endpoints)} addresses were given")
        self.client = client
        self.placement = placement
        self.timeout_s = timeout_s
        self.interrupt = interrupt
        self.peers = [f"ps:{k}" for k in range(placement.num_ps)]
        for peer, address in zip(self.peers, ps_endpoints, strict=True):
            client.connect(peer, address)
        named = dict(model.named_parameters())
        missing = [p.name for p in placement.pieces if p.name not in named]
        if missing:
            raise ValueError(f"the placement names variables the model lacks: {missing[:5]}")
        self.named = named
        self.model = model
        self.layout = ShardLayout(placement)

    def recv(self, peer: str, seq: int, timeout_s: float | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """A wait for a reply: within the request deadline (default timeout_s), and cut short (by whatever
        `interrupt` raises) once a PS was restarted or the PS restored, since a lost PS never answers. A PS that
        was restarted and not restored yet answers `Unserved`: this waits for the restore (see `_await_restore`)."""
        timeout_s = timeout_s or self.timeout_s
        if self.interrupt is None:
            reply = self.client.recv(peer, seq, timeout_s)
        else:
            reply = self._recv_interrupted(peer, seq, timeout_s)
        if Unserved.found_in(reply[0], peer) is not None:
            self._await_restore(peer, timeout_s)
        return reply

    def _recv_interrupted(self, peer: str, seq: int, timeout_s: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
        assert self.interrupt is not None
        deadline = time.monotonic() + timeout_s
        while True:
            slice_s = min(_RESTORE_CHECK_S, deadline - time.monotonic())
            try:
                return self.client.recv(peer, seq, max(slice_s, 0.0))
            except DeadlineExceeded as expired:
                self.interrupt()
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(peer, expired.address, expired.what, timeout_s) from None
            except CommError:
                self.interrupt()  # a PS refuses a push of the training before its restore
                raise

    def _await_restore(self, peer: str, timeout_s: float) -> None:
        """`peer` was restarted and holds nothing yet: what was asked of it belongs to the training before, and
        ends with the chief's restore of every PS (then `interrupt` raises). Raises PSNotRestored if no restore
        came within `timeout_s`, or at once without an `interrupt` to say when it came."""
        problem = f"{peer} at {self.client.address(peer)} was restarted and holds nothing yet"
        if self.interrupt is None:
            raise PSNotRestored(f"{problem}; the chief restores every PS after one was lost")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.interrupt()
            time.sleep(_RESTORE_CHECK_S / 5)
        raise PSNotRestored(f"{problem}, and the chief did not restore the parameter servers within {timeout_s:g}s")

    def exchange(
        self,
        messages: Sequence[protocol.PSRequest],
        frames: Sequence[Sequence[torch.Tensor]] | None = None,
        timeout_s: float | None = None,
    ) -> list[tuple[dict[str, Any], list[torch.Tensor]]]:
        """Send ps:k `messages[k]` (with `frames[k]`), all in parallel; their replies' headers and frames, in PS
        order. A PS that answers with an error raises CommError."""
        if len(messages) != len(self.peers):
            raise ValueError(f"{len(messages)} messages for {len(self.peers)} PS")
        seqs = [
            self.client.send(peer, message.header(), frames[k] if frames is not None else ())
            for k, (peer, message) in enumerate(zip(self.peers, messages, strict=True))
        ]
        return [self.recv(peer, seq, timeout_s) for peer, seq in zip(self.peers, seqs, strict=True)]

    def broadcast(self, message: protocol.PSRequest) -> list[StepReply]:
        """Send every PS `message`; their replies, in PS order."""
        replies = self.exchange([message] * len(self.peers))
        return [StepReply.decode(h, message.op, peer) for (h, _), peer in zip(replies, self.peers, strict=True)]

    def global_step(self) -> int:
        return read_global_step(self.client, self.peers[0], self.timeout_s)

    def reconnect(self, ps_endpoints: Sequence[str]) -> None:
        """Connect to every PS again, at these addresses (a restarted PS may serve elsewhere); requests in flight
        are forgotten."""
        for peer, address in zip(self.peers, ps_endpoints, strict=True):
            self.client.connect(peer, address)
