"""Errors raised by the data plane; each names the peer, its address and what was awaited."""

from __future__ import annotations

from typing import Any


class CommError(RuntimeError):
    """A data-plane request failed: the peer answered with an error or could not be reached."""


class DeadlineExceeded(CommError, TimeoutError):
    """No reply arrived from a peer within the request's deadline."""

    def __init__(self, peer: str, address: str, what: str, timeout_s: float) -> None:
        super().__init__(
            f"no reply from {peer} at {address} within {timeout_s}s to {what}; is the process running and reachable?"
        )
        self.peer = peer
        self.address = address
        self.what = what
        self.timeout_s = timeout_s

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduce would call __init__ with the message alone.
        return (type(self), (self.peer, self.address, self.what, self.timeout_s))


class ProtocolError(CommError):
    """A message did not follow the wire format: bad header, unknown dtype or wrong frame size."""

    def __init__(self, message: str, header: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.header = header
        """The message's header when it could be read, so the sender can still be answered."""
