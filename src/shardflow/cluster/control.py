"""The control service: a small key-value store the chief serves to the roles of its job, over the same ZeroMQ
transport and the same authentication as the data plane (comm/security.py).

It replaces torch's TCPStore, which cannot authenticate and listens on every interface. Operations, each one
request and one reply (comm/ framing; a value travels as one raw frame, never in the header):

- `set` k, frame v -> {}. `get` k -> {"found": bool}, frame v when found. `delete` k -> {"found": bool}.
- `check` ks -> {"set": bool}: whether every key of ks is set.
- `add` k, n -> {"value": int}: an atomic counter (its value is stored as decimal text, as TCPStore does).
- `wait` ks, w -> {"set": bool} once every key of ks is set, or with false after w seconds (w <= 10): held by
  the service, at most MAX_HELD at once; a client waits longer by asking again, so it also rides out a
  restart of the chief.

Every request is validated before use; a malformed one gets an error reply and is counted, never an exception
out of the service's loop. Keys are printable text of at most MAX_KEY characters, values at most MAX_VALUE bytes,
and the store at most MAX_STORED bytes in all.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from shardflow.comm.server import Request, secure_server
from shardflow.ps.fields import ENVELOPE, short

log = logging.getLogger(__name__)

MAX_KEY = 512
MAX_KEYS = 256
MAX_VALUE = 64 * 2**20
MAX_STORED = 1024 * 2**20
MAX_HELD = 10_000
MAX_WAIT_S = 10.0
OPS = ("set", "get", "delete", "check", "add", "wait")
_FIELDS = {"set": ("k",), "get": ("k",), "delete": ("k",), "check": ("ks",), "add": ("k", "n"), "wait": ("ks", "w")}
_FRAMES = {"set": 1}


class ControlRequestError(ValueError):
    """A control request that breaks the protocol; the message names the op, the field and the sender."""


@dataclass(frozen=True)
class ControlRequest:
    op: str
    keys: tuple[str, ...]
    amount: int = 0
    timeout_s: float = 0.0
    value: bytes = b""


def request(op: str, **fields: Any) -> dict[str, Any]:
    """A control request's header, as `decode` reads it (the client side of the protocol)."""
    if set(fields) != set(_FIELDS[op]):
        raise ValueError(f"{op!r} takes the fields {_FIELDS[op]}, got {sorted(fields)}")
    return {"op": op, **fields}


def decode(request: Request) -> ControlRequest:
    """The request, checked against the protocol above; raises ControlRequestError naming what is wrong."""
    header, sender = request.header, request.sender
    op = header.get("op")
    if op not in _FIELDS:
        raise ControlRequestError(f"unknown op {short(op)} from {sender}; the control service knows {', '.join(OPS)}")
    fields = _FIELDS[op]
    unknown = [key for key in header if key not in fields and key not in ENVELOPE]
    if unknown:
        raise ControlRequestError(f"{op!r} from {sender}: {short(unknown[0])} is not a field (it has {fields})")
    missing = [name for name in fields if name not in header]
    if missing:
        raise ControlRequestError(f"{op!r} from {sender}: field {missing[0]!r} is missing")
    if len(request.tensors) != _FRAMES.get(op, 0):
        raise ControlRequestError(f"{op!r} from {sender}: expected {_FRAMES.get(op, 0)} frames")
    keys = _keys(op, sender, header["ks"]) if "ks" in fields else (_key(op, sender, header["k"]),)
    amount = header.get("n", 0)
    if type(amount) is not int or abs(amount) > 2**62:
        raise ControlRequestError(f"{op!r} from {sender}: n must be an int within ±2**62, got {short(amount)}")
    timeout_s = header.get("w", 0.0)
    if type(timeout_s) not in (int, float) or not 0 <= timeout_s <= MAX_WAIT_S:
        problem = f"w must be seconds in [0, {MAX_WAIT_S}], got {short(timeout_s)}"
        raise ControlRequestError(f"{op!r} from {sender}: {problem}")
    value = b""
    if op == "set":
        frame = request.tensors[0]
        if frame.dtype != torch.uint8 or frame.dim() != 1 or frame.numel() > MAX_VALUE:
            raise ControlRequestError(f"'set' from {sender}: the value must be one uint8 frame of <= {MAX_VALUE} bytes")
        value = frame.numpy().tobytes()
    return ControlRequest(op, keys, amount, float(timeout_s), value)


def as_frame(value: bytes) -> torch.Tensor:
    """A value as the one raw frame that carries it (torch.frombuffer refuses an empty buffer)."""
    return torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.empty(0, dtype=torch.uint8)


def _key(op: str, sender: str, key: object) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not key.isprintable():
        raise ControlRequestError(f"{op!r} from {sender}: a key must be printable text of 1..{MAX_KEY} characters")
    return key


def _keys(op: str, sender: str, keys: object) -> tuple[str, ...]:
    if not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS:
        raise ControlRequestError(f"{op!r} from {sender}: ks must be a list of 1..{MAX_KEYS} keys")
    return tuple(_key(op, sender, key) for key in keys)


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
        self._held: list[tuple[float, int, Request, ControlRequest]] = []  # a heap by deadline
        self._order = itertools.count()
        self._last_logged: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="control-service", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()

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
            self._dispatch(request, message)
        except ControlRequestError as error:
            self.stats["refused"] += 1
            self._log(request.sender, f"the control service refused {message.op!r} from {request.sender}: {error}")
            self.server.reply_error(request, str(error))

    def _dispatch(self, request: Request, message: ControlRequest) -> None:
        op, keys = message.op, message.keys
        if op == "set":
            self._store(keys[0], message.value)
            self.server.reply(request, {})
            self._release()
        elif op == "get":
            found = self._values.get(keys[0])
            frames = [] if found is None else [as_frame(found)]
            self.server.reply(request, {"found": found is not None}, frames)
        elif op == "delete":
            removed = self._values.pop(keys[0], None)
            self._stored -= len(removed) if removed is not None else 0
            self.server.reply(request, {"found": removed is not None})
        elif op == "check":
            self.server.reply(request, {"set": all(key in self._values for key in keys)})
        elif op == "add":
            value = self._add(keys[0], message.amount)
            self.server.reply(request, {"value": value})
            self._release()
        elif all(key in self._values for key in keys) or message.timeout_s == 0:
            self.server.reply(request, {"set": all(key in self._values for key in keys)})
        elif len(self._held) >= MAX_HELD:
            raise ControlRequestError(f"{MAX_HELD} waits are held already; ask again later")
        else:
            deadline = time.monotonic() + message.timeout_s
            heapq.heappush(self._held, (deadline, next(self._order), request, message))

    def _store(self, key: str, value: bytes) -> None:
        old = self._values.get(key)
        grown = len(value) - (len(old) if old is not None else 0)
        if self._stored + grown > MAX_STORED:
            raise ControlRequestError(f"the control store is full ({MAX_STORED} bytes); {key!r} was not set")
        self._values[key] = value
        self._stored += grown

    def _add(self, key: str, amount: int) -> int:
        old = self._values.get(key, b"0")
        try:
            value = int(old) + amount
        except ValueError:
            raise ControlRequestError(f"{key!r} holds {short(old)}, not a counter") from None
        self._store(key, str(value).encode())
        return value

    def _release(self) -> None:
        """Answer the held waits whose keys are now all set."""
        if not self._held:
            return
        still = []
        for held in self._held:
            if all(key in self._values for key in held[3].keys):
                self.server.reply(held[2], {"set": True})
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
            self.server.reply(request, {"set": False})

    def _log(self, peer: str, line: str) -> None:
        """At most one line per peer every 10 s, with the count of what was not logged."""
        now = time.monotonic()
        if now - self._last_logged.get(peer, -10.0) >= 10.0:
            if len(self._last_logged) > 10_000:
                self._last_logged.clear()
            self._last_logged[peer] = now
            log.warning("%s (%d malformed or refused so far)", line, self.stats["malformed"] + self.stats["refused"])
