"""torch.distributed's rendezvous through the job's control plane: a `torch.distributed.Store` whose keys live on the
chief's control service (cluster/control.py), so that only holders of the job secret can join a process group. It
replaces the TCPStore, which authenticates nobody and listens on every interface.

`gloo_group` forms a gloo process group through it, with gloo's own connections on the cluster spec's interface."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import TypeVar

from torch._C._distributed_c10d import ProcessGroupGloo, Store

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane, ControlPlaneError

Result = TypeVar("Result")


class DistStoreError(RuntimeError):
    """A rendezvous key that never came, or a control service that did not answer; names the key and whom it waited
    for."""


class ControlPlaneStore(Store):
    """The keys of one process group's formation (`group`, formed for the `generation`-th time), each under
    control_keys.dist_store_prefix on the job's control plane. `members` names the group's ranks, for the errors of
    a wait that expires. `setter` sets a key in place of the control plane's `set` (one that keeps it, to set it
    again on a restarted chief). `interrupt` is called while a key is awaited, and may raise to give the forming up:
    gloo sees a DistStoreError, and what `interrupt` raised is kept in `interrupted`, for the caller to raise again
    once gloo gave up."""

    def __init__(
        self,
        control: ControlPlane,
        group: str,
        generation: int,
        members: Sequence[str],
        timeout_s: float,
        setter: Callable[[str, bytes], None] | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.control = control
        self.setter = setter
        self.interrupt = interrupt
        self.interrupted: BaseException | None = None
        self.prefix = control_keys.dist_store_prefix(group, generation)
        self.members = ", ".join(members)
        self.group = group
        self.timeout_s = timeout_s
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    def _waiting_for(self, keys: Sequence[str]) -> str:
        return f"the ranks of all-reduce group {self.group!r} ({self.members}) to write {', '.join(keys)}"

    def _timeout_s(self, timeout: datetime.timedelta | None = None) -> float:
        return timeout.total_seconds() if timeout is not None else self.timeout_s

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        setter = self.setter or self.control.set
        self._call(lambda: setter(self.prefix + key, data), key)

    def get(self, key: str) -> bytes:
        waiting_for = self._waiting_for([key])
        return self._call(
            lambda: self.control.get_bytes(
                self.prefix + key, waiting_for=waiting_for, timeout_s=self._timeout_s(), interrupt=self._interrupt
            ),
            key,
        )

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda: self.control.add(self.prefix + key, amount), key)

    def check(self, keys: list[str]) -> bool:
        names = [self.prefix + key for key in keys]
        return self._call(lambda: all(self.control.is_set(name) for name in names), ", ".join(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self.prefix + key for key in keys]
        waiting_for = self._waiting_for(keys)
        self._call(
            lambda: self.control.wait(
                names, waiting_for=waiting_for, timeout_s=self._timeout_s(timeout), interrupt=self._interrupt
            ),
            ", ".join(keys),
        )

    def delete_key(self, key: str) -> bool:
        return self._call(lambda: self.control.delete(self.prefix + key), key)

    def num_keys(self) -> int:
        raise DistStoreError(
            f"the control plane keeps no count of the keys of group {self.group!r}; gloo's rendezvous does not ask"
        )

    def _interrupt(self) -> None:
        if self.interrupt is None:
            return
        try:
            self.interrupt()
        except Exception as error:
            self.interrupted = error
            raise _Interrupted(str(error)) from None

    def _call(self, call: Callable[[], Result], key: str) -> Result:
        try:
            return call()
        except (ControlPlaneError, _Interrupted) as error:
            raise DistStoreError(f"all-reduce group {self.group!r}, key {self.prefix + key!r}: {error}") from None


class _Interrupted(Exception):
    """The store's `interrupt` gave a wait up (what it raised is the store's `interrupted`)."""


def gloo_group(store: ControlPlaneStore, rank: int, size: int, host: str, timeout_s: float) -> ProcessGroupGloo:
    """A gloo process group of `size` ranks formed through `store`, this process being `rank`. Its connections
    listen on `host` (this role's host in the cluster spec), not on every interface; each collective fails after
    `timeout_s` without its peers."""
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack it
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return ProcessGroupGloo(store, rank, size, options)
