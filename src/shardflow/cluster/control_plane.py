"""The control plane's client: every role's connection to the chief's control service (cluster/control.py), with
typed values (cluster/control_keys.py `Key`) and waits that say whom they wait for and ride out a restart of the
chief. The chief starts the service with `ControlPlane.serve`."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import torch

from shardflow.cluster import control_keys
from shardflow.cluster.control import (
    MAX_WAIT_S,
    Add,
    AllSet,
    Check,
    ControlOp,
    ControlReply,
    ControlService,
    Counted,
    Delete,
    Found,
    Get,
    Set,
    Wait,
    as_frame,
)
from shardflow.cluster.control_keys import Key, key_name
from shardflow.comm.client import Client
from shardflow.comm.envelope import message_fields
from shardflow.comm.errors import CommError, DeadlineExceeded
from shardflow.comm.security import Credentials, job_credentials
from shardflow.structs import prepared

log = logging.getLogger(__name__)

Value = TypeVar("Value")
Answer = TypeVar("Answer", bound=ControlReply)

_ATTEMPT_S = 2.0
"""How long one request waits for its reply before it is sent again: a restarted chief answers the next one."""
_LOG_EVERY_S = 5.0
_WAIT_LOG_EVERY_S = 10.0
"""A wait for a key logs whom it waits for this often (a slow start-up under load takes a few seconds)."""
_INTERRUPT_EVERY_S = 1.0
"""A wait given an `interrupt` calls it this often at least."""


class ControlPlaneError(RuntimeError):
    """A control-plane wait expired or the chief's control service could not be reached."""


class ControlPlane:
    """Small keys, counters and waits shared by every role of one job; safe to use from several threads."""

    def __init__(
        self,
        chief_address: str,
        *,
        timeout_s: float = 120.0,
        credentials: Credentials | None = None,
        service: ControlService | None = None,
    ) -> None:
        """Connects to the control service at `chief_address` (host:port). A role waits up to `timeout_s` for the
        chief to answer, logging whom it waits for. Credentials default to the job's (comm/security.py). With
        `service` (see `serve`), this plane closes it when it closes."""
        self.address = chief_address
        self.timeout_s = timeout_s
        self.service = service
        self._client = Client("control", credentials=credentials or job_credentials())
        self._client.connect("chief", f"tcp://{chief_address}")
        self._lock = threading.Lock()
        if service is None:
            self._call(Check(keys=(control_keys.SHUTDOWN,)), AllSet, what="to reach the chief's control service")

    @classmethod
    def serve(cls, chief_address: str, *, timeout_s: float = 120.0) -> ControlPlane:
        """Start the job's control service at `chief_address` in this process (the chief's) and connect to it."""
        return cls(chief_address, timeout_s=timeout_s, service=ControlService(chief_address))

    def close(self) -> None:
        with self._lock:
            self._client.close()
        if self.service is not None:
            self.service.close()

    # -- typed values ---------------------------------------------------------------------------------------------

    def put(self, key: Key[Value], value: Value) -> None:
        """Set `key` to `value`, of the key's type."""
        self.set(key.name, key.encode(value))

    def read(self, key: Key[Value], *, waiting_for: str, timeout_s: float | None = None) -> Value:
        """Wait until `key` is set and return its value; raises ControlValueError, naming the key and its writer,
        when the value is not of the key's type."""
        return key.decode(self.get_bytes(key.name, waiting_for=waiting_for, timeout_s=timeout_s))

    def read_if_set(self, key: Key[Value]) -> Value | None:
        """The value of `key` now, or None; never waits for it."""
        data = self.get_if_set(key.name)
        return None if data is None else key.decode(data)

    # -- text and bytes -------------------------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        self._call(Set(key=key), ControlReply, [as_frame(data)], what=key)

    def is_set(self, key: str | Key[Any]) -> bool:
        if self.service is not None:
            return self.service.peek(key_name(key)) is not None
        return self._call(Check(keys=(key_name(key),)), AllSet, what=key_name(key))[0].all_set

    def delete(self, key: str | Key[Any]) -> bool:
        return self._call(Delete(key=key_name(key)), Found, what=key_name(key))[0].found

    def add(self, key: str, amount: int) -> int:
        return self._call(Add(key=key, amount=amount), Counted, what=key)[0].value

    def get(self, key: str, *, waiting_for: str, timeout_s: float | None = None) -> str:
        """Wait until `key` is set; on expiry the error names what was awaited."""
        return self.get_bytes(key, waiting_for=waiting_for, timeout_s=timeout_s).decode()

    def get_bytes(
        self,
        key: str,
        *,
        waiting_for: str,
        timeout_s: float | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> bytes:
        while (value := self.get_if_set(key)) is None:  # one round trip when the key is there already
            self.wait([key], waiting_for=waiting_for, timeout_s=timeout_s, interrupt=interrupt)
        return value

    def get_if_set(self, key: str) -> bytes | None:
        """The value of `key` now, or None; never waits for it. In the chief's process, read from its service
        directly: the chief reads a few keys per worker 20 times a second (train/chief_loop.py), and each round trip
        through the socket cost both ends ~0.3 ms of a core."""
        if self.service is not None:
            return self.service.peek(key)
        reply, frames = self._call(Get(key=key), Found, what=key)
        return bytes(frames[0].numpy().tobytes()) if reply.found else None

    def wait(
        self,
        keys: list[str],
        *,
        waiting_for: str,
        timeout_s: float | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        """Until every key is set; the service holds each wait up to MAX_WAIT_S, then it is asked again. `interrupt`
        is called at least every _INTERRUPT_EVERY_S meanwhile, and may raise to give the wait up."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = start + timeout_s
        next_log = start + _WAIT_LOG_EVERY_S
        longest = _LOG_EVERY_S if interrupt is None else _INTERRUPT_EVERY_S
        while True:
            left = deadline - time.monotonic()
            hold = max(0.0, min(MAX_WAIT_S, left, longest))
            if self._call(Wait(keys=tuple(keys), timeout_s=hold), AllSet, what=waiting_for, extra_s=hold)[0].all_set:
                return
            if interrupt is not None:
                interrupt()
            now = time.monotonic()
            if now >= deadline:
                where = f"key {keys[0]!r} on the control plane at {self.address}"
                raise ControlPlaneError(f"waited {timeout_s:.0f}s for {waiting_for} ({where})")
            if now >= next_log:
                next_log = now + _WAIT_LOG_EVERY_S
                log.warning("still waiting for %s (%.0fs of %.0fs)", waiting_for, now - start, timeout_s)

    def set_within(self, key: str, timeout_s: float, *, waiting_for: str) -> bool:
        """Whether `key` is set, or gets set within `timeout_s` (at most MAX_WAIT_S, held by the service). Raises
        ControlPlaneError only when the chief does not answer."""
        hold = max(0.0, min(MAX_WAIT_S, timeout_s))
        return self._call(Wait(keys=(key,), timeout_s=hold), AllSet, what=waiting_for, extra_s=hold)[0].all_set

    def publish_endpoint(self, name: str, address: str) -> None:
        """Where `name` (e.g. "ps/0") listens."""
        self.set(control_keys.endpoint_address(name), address)

    def endpoint(self, name: str, *, waiting_for: str) -> str:
        return self.get(control_keys.endpoint_address(name), waiting_for=waiting_for)

    def _call(
        self,
        message: ControlOp[Answer],
        answer: type[Answer],
        frames: list[torch.Tensor] | None = None,
        *,
        what: str,
        extra_s: float = 0.0,
    ) -> tuple[Answer, list[torch.Tensor]]:
        """One request, sent again every _ATTEMPT_S (same sequence number: applied once) until the chief answers
        or timeout_s passes; a restarted chief answers the next copy."""
        op = message.__struct_config__.tag
        start = time.monotonic()
        attempt_s = min(_ATTEMPT_S, self.timeout_s)
        retries = max(0, math.ceil(self.timeout_s / attempt_s) - 1)

        def before_retry(attempt: int) -> None:
            if attempt * attempt_s % _LOG_EVERY_S < attempt_s:
                log.warning(
                    "waiting for the chief's control service at %s (%s, %.0fs so far)",
                    self.address,
                    what,
                    time.monotonic() - start,
                )

        header = msgspec.to_builtins(message)
        try:
            with self._lock:
                reply, replied = self._client.request(
                    "chief", header, frames or (), attempt_s + extra_s, retries=retries, before_retry=before_retry
                )
            return msgspec.convert(message_fields(reply), prepared(answer), strict=True), replied
        except DeadlineExceeded:
            raise ControlPlaneError(
                f"the chief's control service at {self.address} did not answer for {self.timeout_s:.0f}s "
                f"({op!r} for {what}): is the chief running and reachable, and does this process hold "
                "the job's secret?"
            ) from None
        except CommError as error:
            raise ControlPlaneError(f"the chief's control service at {self.address}: {error}") from None
        except msgspec.ValidationError as error:
            raise ControlPlaneError(f"the chief's control service at {self.address} answered {op!r}: {error}") from None
