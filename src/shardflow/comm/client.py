"""Request side of the data plane: one DEALER socket per peer, pipelined requests, deadlines, and requests sent
again on a new connection when the one they went out on dropped."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgpack
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from shardflow.comm.envelope import ACKNOWLEDGED, RESENT
from shardflow.comm.errors import CommError, DeadlineExceeded, ProtocolError
from shardflow.comm.framing import NOBLOCK, Receiver, decode, encode, send_frames, timeout_ms
from shardflow.comm.security import Credentials, secure_client_socket

Reply = tuple[dict[str, Any], list[torch.Tensor]]

HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
# Far above any real number of requests in flight: a full queue means the peer is gone.
_SEND_QUEUE_LIMIT = 100_000
# How often a wait for a reply looks whether the connection was made again meanwhile.
_RECONNECT_CHECK_S = 0.5
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""The monitor's events of a handshake that failed: the connection is not made again (`_resend`)."""
# Sent again on one new connection at most: the one made once a silent peer wakes. A request that itself makes the
# server drop the connection (over its size limits) is not sent for ever, and ZeroMQ's queue to a peer whose
# connections keep dropping was seen to stall for good after a few such copies.
_MAX_RESENDS = 1


@dataclass
class _InFlight:
    op: str
    frames: list[Any]
    resends: int = 0


@dataclass
class _Peer:
    name: str
    address: str
    socket: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    """Tells each handshake of `socket`'s connection: a second one is a new connection."""
    pending: dict[int, _InFlight] = field(default_factory=dict)
    """Each request sent and not yet answered, by sequence number."""
    handshakes: int = 0
    arrived: dict[int, Reply] = field(default_factory=dict)
    """Replies that came while waiting for another one, by sequence number."""
    torn_send: bool = False
    """A send stopped between the frames of a message: the socket holds part of it, which the next message would
    complete. The socket is made anew before its next send."""
    receiver: Receiver = field(init=False)

    def __post_init__(self) -> None:
        self.receiver = Receiver(self.socket)


class Client:
    """DEALER socket per peer. Requests are pipelined: send() returns at once, recv() waits with a
    deadline. Every request carries (sender, seq), so the server applies a retried one at most
    once. A connection that dropped (its peer was silent past HEARTBEAT_TIMEOUT_MS: stopped, or
    cut off) loses what was on it; once made again, every request still unanswered is sent again
    on it (see `recv`). A Client belongs to one thread at a time, as its sockets do.
    """

    def __init__(
        self, sender: str, context: zmq.Context[Any] | None = None, credentials: Credentials | None = None
    ) -> None:
        """With `credentials`, every connection proves the job secret (comm/security.py); pass
        `job_credentials()` to talk to a job's servers."""
        self.sender = sender
        self.credentials = credentials
        # A restarted process gets a new id, so its sequence numbers never collide with the
        # ones its previous incarnation used.
        self.sender_id = f"{sender}#{secrets.token_hex(4)}"
        self._context = context or zmq.Context.instance()
        self._peers: dict[str, _Peer] = {}
        self._next_seq = 1

    def connect(self, peer: str, address: str) -> None:
        """Open a socket to `peer` (a role name such as "ps:0") at `address`; a second call for
        the same peer replaces its socket and forgets the requests in flight on it."""
        socket, monitor = self._open(peer, address)
        old = self._peers.pop(peer, None)
        if old is not None:
            _close(old.socket, old.monitor)
        self._peers[peer] = _Peer(peer, address, socket, monitor)

    def _open(self, peer: str, address: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """A socket connecting to `peer` at `address`, and the monitor that tells its handshakes."""
        socket: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        if self.credentials is not None:
            try:
                secure_client_socket(socket, address, self.credentials)
            except Exception:
                socket.close(linger=0)
                raise
        socket.linger = 0
        # ZMTP heartbeats: a connection whose peer went silent (a cut link, a lost host) is dropped and made
        # again within seconds, instead of waiting out TCP's retransmission back-off.
        socket.heartbeat_ivl = HEARTBEAT_IVL_MS
        socket.heartbeat_timeout = HEARTBEAT_TIMEOUT_MS
        socket.sndhwm = _SEND_QUEUE_LIMIT
        socket.rcvhwm = _SEND_QUEUE_LIMIT
        # A fixed routing id keeps replies routable across reconnects (the server enables handover).
        socket.routing_id = self.sender_id.encode()
        monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
        try:
            socket.connect(address)
        except zmq.ZMQError as error:
            _close(socket, monitor)
            raise CommError(f"cannot connect to {peer} at {address!r}: {error}") from error
        return socket, monitor

    def address(self, peer: str) -> str:
        """The address `peer` is connected at."""
        return self._peer(peer).address

    def send(self, peer: str, header: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> int:
        """Send a request without waiting; returns its sequence number for recv().

        Sets header["s"] and header["q"]. Tensors are sent without a copy: do not modify them in
        place until the reply has been received.
        """
        return self._start(self._peer(peer), header, tensors)[0]

    def recv(self, peer: str, seq: int, timeout_s: float) -> Reply:
        """Wait up to `timeout_s` for the reply to request `seq` sent to `peer`.

        Replies to other requests in flight are kept for their own recv(); others are dropped.
        Raises DeadlineExceeded when the time is up (the request stays in flight, so a later
        recv() can still get it) and CommError when the peer replied with an error. A wait that
        finds the connection made again sends every request in flight on it again (`_resend`).
        """
        connection = self._peer(peer)
        reply = connection.arrived.pop(seq, None)
        if reply is not None:
            return _checked(connection, reply)
        if seq not in connection.pending:
            raise ValueError(f"request {seq} is not in flight to {peer}: not sent or already received")
        deadline = time.monotonic() + timeout_s
        while True:
            frames = connection.receiver.recv(timeout_ms(min(deadline - time.monotonic(), _RECONNECT_CHECK_S)))
            if frames is None:
                self._resend(connection)
                if time.monotonic() < deadline:
                    continue
                what = f"{connection.pending[seq].op!r} (seq {seq})"
                raise DeadlineExceeded(peer, connection.address, what, timeout_s)
            try:
                reply = decode(frames)
            except ProtocolError as error:
                raise ProtocolError(f"bad reply from {peer} at {connection.address}: {error}") from error
            reply_seq = reply[0].get("q", 0)
            if reply_seq == seq:
                del connection.pending[seq]
                return _checked(connection, reply)
            if connection.pending.pop(reply_seq, None) is not None:
                connection.arrived[reply_seq] = reply

    def request(
        self,
        peer: str,
        header: dict[str, Any],
        tensors: Sequence[torch.Tensor] = (),
        timeout_s: float = 30.0,
        retries: int = 0,
        before_retry: Callable[[int], None] | None = None,
    ) -> Reply:
        """Send a request and wait for its reply. After each deadline, re-send the same request
        (same sender and seq, which the server applies at most once) up to `retries` times, calling
        `before_retry(attempts so far)` first (it may log, or raise to give up)."""
        connection = self._peer(peer)
        seq, frames = self._start(connection, header, tensors)
        attempts = 1
        while True:
            try:
                return self.recv(peer, seq, timeout_s)
            except (KeyboardInterrupt, SystemExit):  # given up by its caller: no reply will be read
                connection.pending.pop(seq, None)
                raise
            except DeadlineExceeded:
                if attempts > retries:
                    del connection.pending[seq]
                    if retries == 0:
                        raise
                    what = f"{header['op']!r} (seq {seq}, {attempts} attempts)"
                    raise DeadlineExceeded(peer, connection.address, what, timeout_s) from None
                if before_retry is not None:
                    try:
                        before_retry(attempts)
                    except BaseException:
                        del connection.pending[seq]
                        raise
                attempts += 1
                self._send_frames(connection, frames)

    def close(self) -> None:
        """Close every socket at once, dropping unsent requests."""
        for connection in self._peers.values():
            _close(connection.socket, connection.monitor)
        self._peers.clear()

    def __del__(self) -> None:
        # A client dropped without close(): its sockets' monitors go first. A socket collected with its monitor on
        # can leave libzmq unable to connect sockets made after it (seen: a new client's requests never left).
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _peer(self, peer: str) -> _Peer:
        try:
            return self._peers[peer]
        except KeyError:
            known = ", ".join(self._peers) or "none"
            raise ValueError(f"{self.sender} is not connected to {peer} (connected: {known})") from None

    def _start(
        self, connection: _Peer, header: dict[str, Any], tensors: Sequence[torch.Tensor]
    ) -> tuple[int, list[Any]]:
        """Number, encode and send a request; returns its seq and frames for re-sending."""
        op = header.get("op")
        if not isinstance(op, str):
            raise ValueError(f"a request header needs an 'op' string; got {op!r}")
        seq = self._next_seq
        self._next_seq += 1
        header["s"] = self.sender_id
        header["q"] = seq
        # Every reply before the oldest request still in flight has arrived: the server need keep none of them.
        header[ACKNOWLEDGED] = min(connection.pending, default=seq)
        frames = encode(header, tensors)
        self._send_frames(connection, frames)
        connection.pending[seq] = _InFlight(op, frames)
        return seq, frames

    def _resend(self, connection: _Peer) -> None:
        """Once the connection to the peer was made again, every request in flight on it goes out again, oldest
        first: the old connection may have lost the request, or its reply. Marked as resent, so that the server
        applies each at most once by its (sender, seq) and sends the kept reply of one it answered already; a new
        process at the address (a restarted PS) drops them, knowing nothing of this sender."""
        handshakes, failed = connection.handshakes, False
        while connection.monitor.poll(0):
            if recv_monitor_message(connection.monitor)["event"] & _HANDSHAKE_FAILED:
                failed = True
            else:
                connection.handshakes += 1
        if failed and handshakes == connection.handshakes:
            # libzmq gives a connection up for good when its handshake breaks the protocol (whatever squatted the
            # port while the peer was down): what this socket queued may never leave, though it still takes more.
            self._reopen(connection)
            self._send_pending(connection)
            return
        if handshakes == connection.handshakes or connection.handshakes < 2:
            return
        self._send_pending(connection)

    def _send_pending(self, connection: _Peer) -> None:
        """Every request in flight to `connection`, oldest first, marked as resent (`_resend`)."""
        for _, request in sorted(connection.pending.items()):
            if request.resends < _MAX_RESENDS:
                request.resends += 1
                header = msgpack.unpackb(request.frames[0])
                header[RESENT] = True
                self._send_frames(connection, [msgpack.packb(header), *request.frames[1:]])

    def _send_frames(self, connection: _Peer, frames: list[Any]) -> None:
        if connection.torn_send:
            self._reopen(connection)
        for attempt in range(2):
            try:
                connection.torn_send = True  # until the last frame went (a signal handler may raise in between)
                send_frames(connection.socket, frames, NOBLOCK)
                connection.torn_send = False
                return
            except zmq.Again:
                connection.torn_send = False  # refused whole: NOBLOCK sends of a message's frames fail at its first
                if attempt == 1 or len(connection.pending) >= _SEND_QUEUE_LIMIT:
                    raise CommError(
                        f"{_SEND_QUEUE_LIMIT} requests queued for {connection.name} at "
                        f"{connection.address} and none sent; is the process running and reachable, and does this "
                        "process hold the job's secret?"
                    ) from None
            # Nowhere to queue: libzmq gives a connection up for good when its handshake breaks the protocol, as with
            # whatever squatted the port while the peer was down (another mechanism). A new socket connects again.
            # Its first handshake counts as a new connection: what was queued on the old socket is sent again.
            self._reopen(connection)

    def _reopen(self, connection: _Peer) -> None:
        """A new socket to the same peer; its first handshake counts as a new connection, on which every request in
        flight is sent again (`_resend`). The server routes replies to it by the same routing id."""
        _close(connection.socket, connection.monitor)
        connection.socket, connection.monitor = self._open(connection.name, connection.address)
        connection.receiver = Receiver(connection.socket)
        connection.torn_send = False


def _close(socket: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
    socket.disable_monitor()
    monitor.close(linger=0)
    socket.close(linger=0)


def _checked(connection: _Peer, reply: Reply) -> Reply:
    error = reply[0].get("error")
    if error is not None:
        raise CommError(f"{connection.name} at {connection.address}: {error}")
    return reply
