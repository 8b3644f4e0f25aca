"""The control plane: a `torch.distributed.TCPStore` hosted by the chief, with waits that say who they wait for."""

from __future__ import annotations

import datetime
import os
import time

from torch.distributed import TCPStore  # type: ignore[attr-defined]


class ControlPlaneError(RuntimeError):
    """A control-plane wait expired or the chief's store could not be reached."""


class ControlPlane:
    """Small keys, counters and waits shared by every role of one job."""

    def __init__(self, chief_address: str, *, is_chief: bool, timeout_s: float = 120.0) -> None:
        # Under torchrun the elastic agent already serves a store at MASTER_ADDR:MASTER_PORT; the chief joins it.
        hosts_store = is_chief and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        host, _, port = chief_address.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        self.address = chief_address
        self.timeout_s = timeout_s
        try:
            self.store = TCPStore(
                host,
                int(port),
                is_master=hosts_store,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except (RuntimeError, OSError) as error:
            action = "host" if hosts_store else "reach"
            raise ControlPlaneError(
                f"could not {action} the control plane of the chief at {chief_address} within {timeout_s:.0f}s: {error}"
            ) from error

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)  # type: ignore[arg-type]  # TCPStore takes bytes too

    def is_set(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def get(self, key: str, *, waiting_for: str, timeout_s: float | None = None) -> str:
        """Wait until `key` is set; on expiry the error names what was awaited."""
        return self.get_bytes(key, waiting_for=waiting_for, timeout_s=timeout_s).decode()

    def get_bytes(self, key: str, *, waiting_for: str, timeout_s: float | None = None) -> bytes:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not self.is_set(key):
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"waited {timeout_s:.0f}s for {waiting_for} (key {key!r} on the control plane at {self.address})"
                )
            time.sleep(0.02)
        return bytes(self.store.get(key))

    def publish_endpoint(self, name: str, address: str, public_key: bytes | None) -> None:
        """Where `name` (e.g. "ps/0") listens, and its CURVE key when it encrypts."""
        if public_key is not None:
            self.set(f"{name}/curve", public_key)
        self.set(f"{name}/address", address)

    def endpoint(self, name: str, *, waiting_for: str) -> tuple[str, bytes | None]:
        address = self.get(f"{name}/address", waiting_for=waiting_for)
        key = self.get_bytes(f"{name}/curve", waiting_for=waiting_for) if self.is_set(f"{name}/curve") else None
        return address, key

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))
