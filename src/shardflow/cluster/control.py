"""The control service: a small key-value store the chief serves to the roles of its job, over the same ZeroMQ
transport and the same authentication as the data plane (comm/security.py).

It replaces torch's TCPStore, which cannot authenticate and listens on every interface. Each operation is one
request and one reply, declared below once as a typed struct: the union `ControlRequest` decodes every request
and keys the service's handler table. A value travels as one raw frame, never in the header. A `wait` is held
by the service, at most MAX_HELD at once, for at most MAX_WAIT_S; a client waits longer by asking again, so it
also rides out a restart of the chief.

Every request is validated before use; a malformed one gets an error reply naming the op, the field and the
sender, and is counted, never an exception out of the service's loop. Keys are printable text of at most MAX_KEY
characters, values at most MAX_VALUE bytes, and the store at most MAX_STORED bytes in all.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Generic, TypeVar, get_args

import msgspec
import torch

from shardflow.comm.envelope import OP, explain, message_fields, short
from shardflow.comm.server import Request, secure_server
from shardflow.structs import prepared

log = logging.getLogger(__name__)

MAX_KEY = 512
MAX_KEYS = 256
MAX_VALUE = 64 * 2**20
MAX_STORED = 1024 * 2**20
MAX_HELD = 10_000
MAX_WAIT_S = 10.0
MAX_AMOUNT = 2**62

KeyName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_KEY, description=f"printable text of 1..{MAX_KEY} characters")
]
KeyNames = Annotated[
    tuple[KeyName, ...],
    msgspec.Meta(
        min_length=1,
        max_length=MAX_KEYS,
        description=f"a list of 1..{MAX_KEYS} keys, each printable text of 1..{MAX_KEY} characters",
    ),
]


class ControlRequestError(ValueError):
    """A control request that breaks the protocol; the message names the op, the field and the sender."""


# -- replies --------------------------------------------------------------------------------------------------


class ControlReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the service answers; `set` answers this, with no field."""


class Found(ControlReply, frozen=True, kw_only=True):
    found: bool
    """Whether the key was set (a `get` also carries its value as one frame)."""


class AllSet(ControlReply, frozen=True, kw_only=True):
    all_set: bool
    """Whether every key asked about is set."""


class Counted(ControlReply, frozen=True, kw_only=True):
    value: int
    """The counter after the addition."""


Answer = TypeVar("Answer", bound=ControlReply)


# -- requests -------------------------------------------------------------------------------------------------


class ControlOp(msgspec.Struct, Generic[Answer], frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field=OP):
    """A request to the control service, answered by an `Answer`."""

    frames: ClassVar[int] = 0
    """How many raw frames follow the header."""


class _OneKey(ControlOp[Answer], frozen=True, kw_only=True):
    key: KeyName

    def __post_init__(self) -> None:
        _check_printable("key", self.key)


class _SomeKeys(ControlOp[Answer], frozen=True, kw_only=True):
    keys: KeyNames

    def __post_init__(self) -> None:
        for key in self.keys:
            _check_printable("keys", key)


class Set(_OneKey[ControlReply], tag="set", frozen=True, kw_only=True):
    """Store the one frame that follows as the value of `key`."""

    frames: ClassVar[int] = 1


class Get(_OneKey[Found], tag="get", frozen=True, kw_only=True):
    """The value of `key`, as one frame when it is set."""


class Delete(_OneKey[Found], tag="delete", frozen=True, kw_only=True):
    """Remove `key`; found says whether it was set."""


class Check(_SomeKeys[AllSet], tag="check", frozen=True, kw_only=True):
    """Whether every key of `keys` is set, now."""


class Add(_OneKey[Counted], tag="add", frozen=True, kw_only=True):
    """Add `amount` to the counter `key` (stored as decimal text, as TCPStore does; unset counts as 0)."""

    amount: Annotated[int, msgspec.Meta(ge=-MAX_AMOUNT, le=MAX_AMOUNT, description="an int within ±2**62")]


class Wait(_SomeKeys[AllSet], tag="wait", frozen=True, kw_only=True):
    """Answered once every key of `keys` is set, or with false after `timeout_s`."""

    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_WAIT_S, description=f"seconds in [0, {MAX_WAIT_S}]")]


ControlRequest = Set | Get | Delete | Check | Add | Wait
OPS: dict[str, type[ControlOp[Any]]] = {kind.__struct_config__.tag: kind for kind in get_args(ControlRequest)}


def _check_printable(field: str, key: str) -> None:
    if not key.isprintable():
        raise ValueError(f"{field} must hold printable text of 1..{MAX_KEY} characters, got {short(key)}")


def decode(request: Request) -> ControlRequest:
    """The request, checked against the protocol above; raises ControlRequestError naming what is wrong."""
    header, sender = request.header, request.sender
    op = header.get(OP)
    kind = OPS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise ControlRequestError(f"unknown op {short(op)} from {sender}; the control service knows {', '.join(OPS)}")
    try:
        message: ControlRequest = msgspec.convert(message_fields(header), prepared(ControlRequest), strict=True)
    except msgspec.ValidationError as error:
        field, problem = explain(error, header, kind)
        raise ControlRequestError(f"{op!r} from {sender}: {field} {problem}") from None
    if len(request.tensors) != kind.frames:
        raise ControlRequestError(f"{op!r} from {sender}: expected {kind.frames} frames, got {len(request.tensors)}")
    if isinstance(message, Set):
        frame = request.tensors[0]
        if frame.dtype != torch.uint8 or frame.dim() != 1 or frame.numel() > MAX_VALUE:
            raise ControlRequestError(f"'set' from {sender}: the value must be one uint8 frame of <= {MAX_VALUE} bytes")
    return message


def value_of(request: Request) -> bytes:
    """The value a decoded `set` carries."""
    return bytes(request.tensors[0].numpy().tobytes())


def as_frame(value: bytes) -> torch.Tensor:
    """A value as the one raw frame that carries it (torch.frombuffer refuses an empty buffer)."""
    return torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.empty(0, dtype=torch.uint8)


class ControlService:
    """Serves the job's control plane from a thread of the chief's process, until close()."""

    def __init__(self, address: str) -> None:
        """Listens at `address` (host:port of the chief in the cluster spec): on it when it is loopback, else on
        every interface (or SHARDFLOW_BIND_ADDRESS), accepting only holders of the job secret."""
        self.server = secure_server(f"tcp://{address}")
        self.address = address
        self.stats = {"requests": 0, "malformed": 0, "refused": 0, "expired": 0}
        self._values: dict[str, bytes] = {}
        self._stored = 0
        self._held: list[tuple[float, int, Request, Wait]] = []  # a heap by deadline
        self._order = itertools.count()
        self._last_logged: dict[str, float] = {}
        self._handlers: dict[type[ControlOp[Any]], Callable[[Request, Any], None]] = {
            Set: self._set,
            Get: self._get,
            Delete: self._delete,
            Check: self._check,
            Add: self._add,
            Wait: self._wait,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="control-service", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()

    def peek(self, key: str) -> bytes | None:
        """The value of `key` now, for the plane of this same process: its thread alone writes the values, and a
        read of one is a single step under the GIL. Writes and waits go through the socket, in order with the
        other roles' (a write's reply comes once it is stored, so the writer's next peek sees it)."""
        return self._values.get(key)

    def _serve(self) -> None:
        while not self._stop.is_set():
            wait_s = 0.1 if not self._held else max(0.0, min(0.1, self._held[0][0] - time.monotonic()))
            request = self.server.recv(timeout_s=wait_s)
            if request is not None:
                self._handle(request)
            self._expire()

    def _handle(self, request: Request) -> None:
        self.stats["requests"] += 1
        try:
            message = decode(request)
        except ControlRequestError as error:
            self.stats["malformed"] += 1
            self._log(request.sender, f"the control service refused a malformed request: {error}")
            self.server.reply_error(request, f"malformed control request: {error}")
            return
        try:
            self._handlers[type(message)](request, message)
        except ControlRequestError as error:
            self.stats["refused"] += 1
            op = message.__struct_config__.tag
            self._log(request.sender, f"the control service refused {op!r} from {request.sender}: {error}")
            self.server.reply_error(request, str(error))

    def _reply(self, request: Request, reply: ControlReply, frames: list[torch.Tensor] | None = None) -> None:
        self.server.reply(request, msgspec.structs.asdict(reply), frames or ())

    def _set(self, request: Request, message: Set) -> None:
        self._store(message.key, value_of(request))
        self._reply(request, ControlReply())
        self._release()

    def _get(self, request: Request, message: Get) -> None:
        found = self._values.get(message.key)
        self._reply(request, Found(found=found is not None), [] if found is None else [as_frame(found)])

    def _delete(self, request: Request, message: Delete) -> None:
        removed = self._values.pop(message.key, None)
        self._stored -= len(removed) if removed is not None else 0
        self._reply(request, Found(found=removed is not None))

    def _check(self, request: Request, message: Check) -> None:
        self._reply(request, AllSet(all_set=self._all_set(message.keys)))

    def _add(self, request: Request, message: Add) -> None:
        old = self._values.get(message.key, b"0")
        try:
            value = int(old) + message.amount
        except ValueError:
            raise ControlRequestError(f"{message.key!r} holds {short(old)}, not a counter") from None
        self._store(message.key, str(value).encode())
        self._reply(request, Counted(value=value))
        self._release()

    def _wait(self, request: Request, message: Wait) -> None:
        if self._all_set(message.keys) or message.timeout_s == 0:
            self._reply(request, AllSet(all_set=self._all_set(message.keys)))
        elif len(self._held) >= MAX_HELD:
            raise ControlRequestError(f"{MAX_HELD} waits are held already; ask again later")
        else:
            deadline = time.monotonic() + message.timeout_s
            heapq.heappush(self._held, (deadline, next(self._order), request, message))

    def _all_set(self, keys: tuple[str, ...]) -> bool:
        return all(key in self._values for key in keys)

    def _store(self, key: str, value: bytes) -> None:
        old = self._values.get(key)
        grown = len(value) - (len(old) if old is not None else 0)
        if self._stored + grown > MAX_STORED:
            raise ControlRequestError(f"the control store is full ({MAX_STORED} bytes); {key!r} was not set")
        self._values[key] = value
        self._stored += grown

    def _release(self) -> None:
        """Answer the held waits whose keys are now all set."""
        if not self._held:
            return
        still = []
        for held in self._held:
            if self._all_set(held[3].keys):
                self._reply(held[2], AllSet(all_set=True))
            else:
                still.append(held)
        if len(still) != len(self._held):
            heapq.heapify(still)
            self._held = still

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            _, _, request, _ = heapq.heappop(self._held)
            self.stats["expired"] += 1
            self._reply(request, AllSet(all_set=False))

    def _log(self, peer: str, line: str) -> None:
        """At most one line per peer every 10 s, with the count of what was not logged."""
        now = time.monotonic()
        if now - self._last_logged.get(peer, -10.0) >= 10.0:
            if len(self._last_logged) > 10_000:
                self._last_logged.clear()
            self._last_logged[peer] = now
            log.warning("%s (%d malformed or refused so far)", line, self.stats["malformed"] + self.stats["refused"])
