"""Serving side of the data plane: a ROUTER socket that delivers each request at most once."""

from __future__ import annotations

import logging
import math
import reprlib
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import torch
import zmq

from shardflow import env
from shardflow.comm.client import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from shardflow.comm.envelope import ACKNOWLEDGED, RESENT
from shardflow.comm.errors import CommError, ProtocolError
from shardflow.comm.framing import (
    SNDMORE,
    OverLimit,
    Receiver,
    WireLimits,
    decode,
    encode,
    peek_header,
    send_frames,
    timeout_ms,
)
from shardflow.comm.security import (
    NULL,
    Credentials,
    is_loopback,
    job_credentials,
    secure_server_socket,
    watch_handshakes,
)

logger = logging.getLogger(__name__)

# Senders remembered for duplicate detection; the least recently heard from is forgotten beyond this,
# which only matters once this many client incarnations have talked to one server.
_MAX_SENDERS = 1024
_MAX_SENDER_CHARS = 256
_QUEUE_LIMIT = 100_000
# Per sender, far above the requests one has in flight: beyond them, the oldest delivered are taken for settled
# (a client that gives up requests, as the chief's status polls of a silent PS, never acknowledges them). A reply
# may hold a PS's parameters: the replies kept are bounded by count and by bytes. A client with many requests in
# flight (the fuzz test keeps about 70) gets every reply of them again after its connection was made again.
_MAX_DELIVERED = 4096
_MAX_REPLIES_KEPT = 256
_MAX_REPLY_BYTES_KEPT = 64 << 20


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
    floor: int
    """Every sequence number at or below it counts as delivered: the client acknowledged its reply."""
    delivered: set[int] = field(default_factory=set)
    """The sequence numbers above `floor` delivered: a request sent again on a new connection may come after a
    later one, so a higher number delivered says nothing of a lower one."""
    replies: dict[int, list[Any]] = field(default_factory=dict)
    """Replies kept for a retry of their request, by sequence number, until the client acknowledges them."""
    reply_bytes: int = 0
    """The bytes of the frames in `replies`."""

    def keep(self, seq: int, frames: list[Any]) -> None:
        self.replies[seq] = frames
        self.reply_bytes += _size(frames)

    def settle(self, acknowledged: int) -> None:
        """The client has every reply before `acknowledged`: forget them."""
        floor = self.floor
        if acknowledged - 1 > floor:
            self.floor = acknowledged - 1
            for seq in [seq for seq in self.replies if seq <= self.floor]:
                self.reply_bytes -= _size(self.replies.pop(seq))
        if len(self.delivered) > _MAX_DELIVERED:
            self.floor = max(self.floor, sorted(self.delivered)[len(self.delivered) // 2])
        if self.floor > floor and len(self.delivered) > 16:
            self.delivered = {seq for seq in self.delivered if seq > self.floor}
        while len(self.replies) > _MAX_REPLIES_KEPT or self.reply_bytes > _MAX_REPLY_BYTES_KEPT:
            self.reply_bytes -= _size(self.replies.pop(next(iter(self.replies))))

    def is_new(self, seq: int) -> bool:
        if seq <= self.floor or seq in self.delivered:
            return False
        self.delivered.add(seq)
        return True


def _size(frames: list[Any]) -> int:
    return sum(frame.nbytes if isinstance(frame, memoryview) else len(frame) for frame in frames)


class Server:
    """ROUTER socket. Requests are delivered at most once per (sender, seq); a duplicate (a client
    retry, or a request sent again on a new connection) is never delivered again: the server
    re-sends the kept reply if that seq was already answered, and drops it otherwise (the pending
    reply will reach the same socket). A request sent again to a server that does not know its
    sender (a new process at the address) is dropped: it was meant for the one before.

    Replies may be sent in any order and at any later time. A Server belongs to one thread.
    """

    def __init__(
        self,
        bind: str,
        context: zmq.Context[Any] | None = None,
        credentials: Credentials | None = None,
        advertise: str | None = None,
        limits: WireLimits | None = None,
        local: str | None = None,
    ) -> None:
        """With `credentials`, only holders of the job secret get in (comm/security.py); the mechanism follows
        `advertise` (the address clients use, default `bind`), so that it matches what clients pick. `local`, an
        ipc:// endpoint, is listened on as well, for the processes of this machine (see `local_address`)."""
        self._socket: zmq.Socket[bytes] = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self.mechanism = "null"
        if credentials is not None:
            try:
                self.mechanism = secure_server_socket(self._socket, advertise or bind, credentials)
                if self.mechanism != NULL:
                    watch_handshakes(self._socket)
            except Exception:
                self._socket.close(linger=0)
                raise
        self._socket.linger = 0
        self._socket.heartbeat_ivl = HEARTBEAT_IVL_MS
        self._socket.heartbeat_timeout = HEARTBEAT_TIMEOUT_MS
        self._socket.sndhwm = _QUEUE_LIMIT
        self._socket.rcvhwm = _QUEUE_LIMIT
        # A client that reconnects keeps its routing id; let the new connection take it over.
        self._socket.router_handover = 1
        self._receiver = Receiver(self._socket, limits or WireLimits(), envelope=1)  # sets MAXMSGSIZE: before bind
        try:
            self._socket.bind(bind)
        except zmq.ZMQError as error:
            self._socket.close(linger=0)
            raise CommError(f"cannot bind {bind!r}: {error}") from error
        bound = self._socket.last_endpoint.decode()
        self.address = _advertised(advertise, bound) if advertise else _connectable(bound)
        self.local_address: str | None = None
        """An ipc:// endpoint the processes of this machine reach this server at, or None. A UNIX socket costs
        a fraction of loopback TCP's CPU time per byte (the kernel skips the TCP stack): a local cluster's PS
        traffic moves megabytes per step. The same secret admits a client (by PLAIN in a private directory)."""
        if local is not None:
            try:
                if credentials is not None:  # a listener keeps the mechanism set when it was bound: TCP's stays
                    secure_server_socket(self._socket, local, credentials)
                self._socket.bind(local)
                self.local_address = local
            except zmq.ZMQError as error:  # e.g. a path over the 107 bytes a UNIX socket's name may have
                logger.warning("cannot listen on %s (%s); this machine's processes use %s", local, error, self.address)
        self.duplicates = 0
        """Requests seen again (client retries) and not delivered."""
        self.malformed = 0
        """Messages that did not follow the wire format, answered with an error or dropped."""
        self._senders: dict[str, _Sender] = {}

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
        if state is not None and request.seq > state.floor:
            state.keep(request.seq, frames)

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
        if isinstance(frames, OverLimit):
            self._reject(identity, peek_header(frames[1:]), f"over the server's limits: {frames.problem}")
            return None
        try:
            header, tensors = decode(frames[1:])
        except ProtocolError as error:
            self._reject(identity, error.header or {}, str(error))
            return None
        sender = header.get("s")
        seq = header.get("q")
        if not (
            type(sender) is str
            and len(sender) <= _MAX_SENDER_CHARS
            and type(seq) is int
            and type(header.get("op")) is str
        ):
            problem = f"a request header needs 'op' (str), 's' (str of at most {_MAX_SENDER_CHARS}) and 'q' (int)"
            self._reject(identity, header, problem)
            return None
        acknowledged = header.get(ACKNOWLEDGED)
        acknowledged = acknowledged if type(acknowledged) is int and acknowledged <= seq else seq
        state = self._senders.pop(sender, None)
        if state is None:
            if header.get(RESENT):
                self.duplicates += 1
                return None
            if len(self._senders) >= _MAX_SENDERS:
                del self._senders[next(iter(self._senders))]  # the least recently heard from
            state = _Sender(acknowledged - 1)
        self._senders[sender] = state  # now the most recently heard from
        state.settle(acknowledged)
        if state.is_new(seq):
            return Request(identity, header, tensors)
        self.duplicates += 1
        kept = state.replies.get(seq)
        if kept is not None:
            self._send(identity, kept)
        return None

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        # A ROUTER never blocks: a reply to a client that is gone is dropped.
        self._socket.send(identity, SNDMORE)
        send_frames(self._socket, frames)

    def _reject(self, identity: bytes, header: dict[str, Any], problem: str) -> None:
        self.malformed += 1
        sender = header.get("s")
        peer = reprlib.repr(sender) if type(sender) is str else "an unnamed sender"
        held_back = _MALFORMED_LOG.allow(sender if type(sender) is str else identity, header.get("op"))
        if held_back is not None:
            logger.warning(
                "malformed request from %s (routing id %r): %s (%d malformed so far; %d other warnings held back)",
                peer,
                identity,
                problem,
                self.malformed,
                held_back,
            )
        reply: dict[str, Any] = {"error": f"malformed request: {problem}"}
        if "q" in header:  # without it the client cannot match the reply, but it does no harm
            reply["q"] = header["q"]
        try:
            self._send(identity, encode(reply))
        except (zmq.ZMQError, TypeError, ValueError):
            logger.warning("could not answer the malformed request from %s (routing id %r)", peer, identity)


class LogLimiter:
    """Rate-limits warnings about what peers send: one line per (peer, what) every `every_s` seconds and at most
    `max_lines` in all per `every_s`, so that neither one bad peer nor many made-up ones flood the log. The lines
    held back, whatever their peer, are counted, and the count goes with the next line let through."""

    def __init__(self, every_s: float = 10.0, max_lines: int = 20, max_keys: int = 1024) -> None:
        self.every_s, self.max_lines, self.max_keys = every_s, max_lines, max_keys
        self.held_back = 0
        """Lines held back since the last one let through."""
        self._last: dict[tuple[str, str], float] = {}
        self._window_start, self._window_lines = -math.inf, 0

    def allow(self, peer: object, what: object) -> int | None:
        """None when a line about `peer` and `what` is to be held back; else how many were held back before it."""
        now = time.monotonic()
        key = (reprlib.repr(peer), reprlib.repr(what))
        if now - self._window_start >= self.every_s:
            self._window_start, self._window_lines = now, 0
        if now - self._last.get(key, -math.inf) < self.every_s or self._window_lines >= self.max_lines:
            self.held_back += 1
            return None
        self._window_lines += 1
        self._last.pop(key, None)
        if len(self._last) >= self.max_keys:
            del self._last[next(iter(self._last))]  # the longest silent
        self._last[key] = now
        held_back, self.held_back = self.held_back, 0
        return held_back


# One per process: its servers share one budget of lines about malformed requests.
_MALFORMED_LOG = LogLimiter()


def secure_server(advertised: str, bind: str | None = None, local: str | None = None) -> Server:
    """A Server at `advertised` (a tcp:// endpoint peers connect to; port 0 picks one) that accepts only holders
    of the job secret. It listens on `advertised` itself when that is loopback, else on `bind` (default: every
    interface, or SHARDFLOW_BIND_ADDRESS), as TensorFlow's servers do; and on `local` (ipc://) when given."""
    if bind is None:
        bind = advertised if is_loopback(advertised) else _wildcard(advertised)
    return Server(bind, credentials=job_credentials(), advertise=advertised, local=local)


def _wildcard(advertised: str) -> str:
    port = urlsplit(advertised).port
    host = env.get(env.BIND_ADDRESS) or "*"
    return f"tcp://{host}:{port if port is not None else 0}"


def _advertised(advertise: str, bound: str) -> str:
    """`advertise` with the port the socket got, when it asked for any port (0)."""
    if urlsplit(advertise).port != 0:
        return advertise
    return f"{advertise.rpartition(':')[0]}:{urlsplit(bound).port}"


def _connectable(endpoint: str) -> str:
    """The endpoint a peer can connect to: a wildcard bind is reached through the host name."""
    for wildcard in ("//0.0.0.0:", "//[::]:"):
        if wildcard in endpoint:
            return endpoint.replace(wildcard, f"//{socket.gethostname()}:")
    return endpoint
