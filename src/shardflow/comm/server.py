"""Serving side of the data plane: a ROUTER socket that delivers each request at most once."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import zmq

from shardflow import env
from shardflow.comm.errors import CommError, ProtocolError
from shardflow.comm.framing import SNDMORE, Receiver, decode, encode, send_frames, timeout_ms
from shardflow.comm.security import (
    CurveKeys,
    client_keys,
    is_loopback,
    secure_socket,
    server_keys,
)

logger = logging.getLogger(__name__)

# Senders remembered for duplicate detection; the oldest is forgotten beyond this, which only
# matters once this many client incarnations have talked to one server.
_MAX_SENDERS = 1024
_QUEUE_LIMIT = 100_000


@dataclass
class Request:
    """A request as delivered by Server.recv(); answer it with Server.reply()."""

    identity: bytes
    """ZeroMQ routing id of the client's socket."""
    header: dict[str, Any]
    tensors: list[torch.Tensor]
    """Read-only views over the received frames."""

    @property
    def op(self) -> str:
        return str(self.header["op"])

    @property
    def sender(self) -> str:
        return str(self.header["s"])

    @property
    def seq(self) -> int:
        return int(self.header["q"])


@dataclass
class _Sender:
    highest_seq: int
    """Highest sequence number delivered; anything at or below it is a duplicate."""
    reply_seq: int = -1
    reply_frames: list[Any] | None = None


class Server:
    """ROUTER socket. Requests are delivered at most once per (sender, seq); a duplicate (a client
    retry) is never delivered again: the server re-sends the cached reply if that seq was already
    answered, and drops it otherwise (the pending reply will reach the same socket).

    Replies may be sent in any order and at any later time. A Server belongs to one thread.
    """

    def __init__(
        self,
        bind: str,
        context: zmq.Context[Any] | None = None,
        curve: CurveKeys | None = None,
        allowed_client: bytes | None = None,
    ) -> None:
        """With `curve`, traffic is encrypted (CURVE) and, with `allowed_client`, only that key may connect;
        `public_key` then says what clients must pass to Client.connect."""
        self._socket: zmq.Socket[bytes] = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self.public_key = curve.public if curve is not None else None
        if curve is not None:
            secure_socket(self._socket, curve, allowed_client)
        self._socket.linger = 0
        self._socket.sndhwm = _QUEUE_LIMIT
        self._socket.rcvhwm = _QUEUE_LIMIT
        # A client that reconnects keeps its routing id; let the new connection take it over.
        self._socket.router_handover = 1
        try:
            self._socket.bind(bind)
        except zmq.ZMQError as error:
            self._socket.close(linger=0)
            raise CommError(f"cannot bind {bind!r}: {error}") from error
        self.address = _connectable(self._socket.last_endpoint.decode())
        self.duplicates = 0
        """Requests seen again (client retries) and not delivered."""
        self.malformed = 0
        """Messages that did not follow the wire format, answered with an error or dropped."""
        self._senders: dict[str, _Sender] = {}
        self._receiver = Receiver(self._socket)

    def recv(self, timeout_s: float | None) -> Request | None:
        """The next new request, or None once `timeout_s` passes (None waits forever)."""
        if timeout_s is None:
            deadline, wait_ms = None, -1
        else:
            deadline, wait_ms = time.monotonic() + timeout_s, timeout_ms(timeout_s)
        while True:
            frames = self._receiver.recv(wait_ms)
            if frames is None:
                return None
            request = self._accept(frames)
            if request is not None:
                return request
            if deadline is not None:
                wait_ms = timeout_ms(deadline - time.monotonic())

    def reply(
        self,
        request: Request,
        header: dict[str, Any],
        tensors: Sequence[torch.Tensor] = (),
    ) -> None:
        """Answer `request`; sets header["q"] and header["s"] to the request's.

        Tensors are sent without a copy and kept for re-sending to a retrying client: pass
        clones of tensors that will be modified in place before the client has them.
        """
        header["q"] = request.seq
        header["s"] = request.sender
        frames = encode(header, tensors)
        self._send(request.identity, frames)
        state = self._senders.get(request.sender)
        if state is not None:
            state.reply_seq = request.seq
            state.reply_frames = frames

    def reply_error(self, request: Request, message: str) -> None:
        """Answer `request` with an error; the client raises CommError with `message`."""
        self.reply(request, {"error": message})

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self, frames: list[zmq.Frame]) -> Request | None:
        identity = frames[0].bytes
        try:
            header, tensors = decode(frames[1:])
        except ProtocolError as error:
            self._reject(identity, error.header or {}, str(error))
            return None
        sender = header.get("s")
        seq = header.get("q")
        if not (isinstance(sender, str) and type(seq) is int and isinstance(header.get("op"), str)):
            self._reject(identity, header, "a request header needs 'op' (str), 's' (str) and 'q' (int)")
            return None
        state = self._senders.get(sender)
        if state is None:
            if len(self._senders) >= _MAX_SENDERS:
                del self._senders[next(iter(self._senders))]
            self._senders[sender] = _Sender(seq)
        elif seq > state.highest_seq:
            state.highest_seq = seq
        else:
            self.duplicates += 1
            if seq == state.reply_seq and state.reply_frames is not None:
                self._send(identity, state.reply_frames)
            return None
        return Request(identity, header, tensors)

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        # A ROUTER never blocks: a reply to a client that is gone is dropped.
        self._socket.send(identity, SNDMORE)
        send_frames(self._socket, frames)

    def _reject(self, identity: bytes, header: dict[str, Any], problem: str) -> None:
        self.malformed += 1
        sender = header.get("s", "an unknown sender")
        logger.warning("malformed request from %s (routing id %r): %s", sender, identity, problem)
        reply: dict[str, Any] = {"error": f"malformed request: {problem}"}
        if "q" in header:  # without it the client cannot match the reply, but it does no harm
            reply["q"] = header["q"]
        try:
            self._send(identity, encode(reply))
        except (zmq.ZMQError, TypeError, ValueError):
            logger.warning("could not answer the malformed request from %s", sender)


def secure_server(bind: str) -> Server:
    """A Server that encrypts (CURVE) unless it binds to loopback; with SHARDFLOW_CLUSTER_SECRET set, it also
    accepts only clients that hold the secret."""
    if is_loopback(bind) and env.get(env.ENCRYPT) != "always":
        return Server(bind)
    allowed = client_keys().public if env.get(env.CLUSTER_SECRET) else None
    return Server(bind, curve=server_keys(), allowed_client=allowed)


def _connectable(endpoint: str) -> str:
    """The endpoint a peer can connect to: a wildcard bind is reached through the host name."""
    for wildcard in ("//0.0.0.0:", "//[::]:"):
        if wildcard in endpoint:
            return endpoint.replace(wildcard, f"//{socket.gethostname()}:")
    return endpoint
