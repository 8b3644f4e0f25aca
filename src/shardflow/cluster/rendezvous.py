"""The control plane's client: every role's connection to the chief's control service (cluster/control.py), with
waits that say whom they wait for and ride out a restart of the chief."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch

from shardflow.cluster import control, control_keys
from shardflow.cluster.control import MAX_WAIT_S, ControlService, as_frame
from shardflow.comm.client import Client
from shardflow.comm.errors import CommError, DeadlineExceeded
from shardflow.comm.security import Credentials, job_credentials

log = logging.getLogger(__name__)

_ATTEMPT_S = 2.0
"""How long one request waits for its reply before it is sent again: a restarted chief answers the next one."""
_LOG_EVERY_S = 5.0
_WAIT_LOG_EVERY_S = 10.0
"""A wait for a key logs whom it waits for this often (a slow start-up under load takes a few seconds)."""


class ControlPlaneError(RuntimeError):
    """A control-plane wait expired or the chief's control service could not be reached."""


class ControlPlane:
    """Small keys, counters and waits shared by every role of one job; safe to use from several threads."""

    def __init__(
        self, chief_address: str, *, is_chief: bool, timeout_s: float = 120.0, credentials: Credentials | None = None
    ) -> None:
        """Connects to the control service at `chief_address` (host:port), which the chief (`is_chief`) serves
        itself. A role waits up to `timeout_s` for the chief to answer, logging whom it waits for. Credentials
        default to the job's (comm/security.py)."""
        self.address = chief_address
        self.timeout_s = timeout_s
        self.service = ControlService(chief_address) if is_chief else None
        self._client = Client("control", credentials=credentials or job_credentials())
        self._client.connect("chief", f"tcp://{chief_address}")
        self._lock = threading.Lock()
        if not is_chief:
            self._request(
                control.request("check", ks=[control_keys.SHUTDOWN]), what="to reach the chief's control service"
            )

    def close(self) -> None:
        with self._lock:
            self._client.close()
        if self.service is not None:
            self.service.close()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        self._request(control.request("set", k=key), [as_frame(data)], what=key)

    def is_set(self, key: str) -> bool:
        return bool(self._request(control.request("check", ks=[key]), what=key)[0]["set"])

    def delete(self, key: str) -> bool:
        return bool(self._request(control.request("delete", k=key), what=key)[0]["found"])

    def add(self, key: str, amount: int) -> int:
        return int(self._request(control.request("add", k=key, n=amount), what=key)[0]["value"])

    def get(self, key: str, *, waiting_for: str, timeout_s: float | None = None) -> str:
        """Wait until `key` is set; on expiry the error names what was awaited."""
        return self.get_bytes(key, waiting_for=waiting_for, timeout_s=timeout_s).decode()

    def get_bytes(self, key: str, *, waiting_for: str, timeout_s: float | None = None) -> bytes:
        while (value := self.get_if_set(key)) is None:  # one round trip when the key is there already
            self.wait([key], waiting_for=waiting_for, timeout_s=timeout_s)
        return value

    def get_if_set(self, key: str) -> bytes | None:
        """The value of `key` now, or None; never waits for it."""
        header, frames = self._request(control.request("get", k=key), what=key)
        return frames[0].numpy().tobytes() if header["found"] else None

    def wait(self, keys: list[str], *, waiting_for: str, timeout_s: float | None = None) -> None:
        """Until every key is set; the service holds each wait up to MAX_WAIT_S, then it is asked again."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = start + timeout_s
        next_log = start + _WAIT_LOG_EVERY_S
        while True:
            left = deadline - time.monotonic()
            hold = max(0.0, min(MAX_WAIT_S, left, _LOG_EVERY_S))
            header, _ = self._request(control.request("wait", ks=keys, w=hold), what=waiting_for, extra_s=hold)
            if header["set"]:
                return
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
        header, _ = self._request(control.request("wait", ks=[key], w=hold), what=waiting_for, extra_s=hold)
        return bool(header["set"])

    def publish_endpoint(self, name: str, address: str) -> None:
        """Where `name` (e.g. "ps/0") listens."""
        self.set(control_keys.endpoint_address(name), address)

    def endpoint(self, name: str, *, waiting_for: str) -> str:
        return self.get(control_keys.endpoint_address(name), waiting_for=waiting_for)

    def _request(
        self, header: dict[str, Any], frames: list[torch.Tensor] | None = None, *, what: str, extra_s: float = 0.0
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """One request, sent again every _ATTEMPT_S (same sequence number: applied once) until the chief answers
        or timeout_s passes; a restarted chief answers the next copy."""
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

        try:
            with self._lock:
                return self._client.request(
                    "chief", header, frames or (), attempt_s + extra_s, retries=retries, before_retry=before_retry
                )
        except DeadlineExceeded:
            raise ControlPlaneError(
                f"the chief's control service at {self.address} did not answer for {self.timeout_s:.0f}s "
                f"({header['op']!r} for {what}): is the chief running and reachable, and does this process hold "
                "the job's secret?"
            ) from None
        except CommError as error:
            raise ControlPlaneError(f"the chief's control service at {self.address}: {error}") from None
