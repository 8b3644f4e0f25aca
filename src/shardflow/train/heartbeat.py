"""A role's heartbeat: a beat every second on the control plane, from a thread and a connection of its own, from
the role's start to its end; and the chief's watch of them (Heartbeats). What the role's supervisor watches is its
liveness file, touched by a thread that waits for nobody (cluster/liveness.py): a beat may wait for a slow chief."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.comm.errors import CommError
from shardflow.train.job import RoleFailedError
from shardflow.train.strategy import ParameterServerStrategy

log = logging.getLogger(__name__)


class Heartbeat:
    """Beats every second, or four times per `timeout_s` where that is shorter, while the role runs: a step of any
    length, or a long start-up, is never taken for a lost role, and a restarted role's beats carry its new pid."""

    def __init__(self, name: str, control: ControlPlane, timeout_s: float) -> None:
        """Beats as role `name` on a connection of its own to the control plane `control` reaches; `timeout_s`:
        the strategy's heartbeat_timeout_s, which a beat a second would all but fill when it is short."""
        self._key = control_keys.heartbeat(name)
        self._control = ControlPlane(control.address, timeout_s=control.timeout_s)
        self._interval_s = min(1.0, timeout_s / 4)
        self._stopped = threading.Event()
        self._beat(0)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, count: int) -> None:
        self._control.set(self._key, f"{os.getpid()}:{count}")

    def _run(self) -> None:
        count = 1
        while not self._stopped.wait(self._interval_s):
            try:
                self._beat(count)
            except (RuntimeError, OSError, ValueError):  # the chief is gone, or stop() closed the connection
                return
            count += 1

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2 * self._interval_s)
        self._control.close()


class PSRestarted(CommError):
    """A PS was restarted while the chief waited for its answer, which will never come."""


class Heartbeats:
    """Which workers and PS beat (Heartbeat), which are lost, and for how long.

    A worker silent for heartbeat_timeout_s (startup_timeout_s before its first beat) is lost: the chief logs it
    and training goes on without it, while whoever supervises the process (the local launcher, the cluster
    manager) restarts it; the restarted worker resumes where the PS say it stopped. One still lost after
    worker_rejoin_timeout_s fails the job, naming it."""

    def __init__(self, control: ControlPlane, strategy: ParameterServerStrategy) -> None:
        self.control = control
        self.strategy = strategy
        self.started: float | None = None
        """When the chief first checked: a role's first beat is awaited for startup_timeout_s from then."""
        self._beats: dict[str, tuple[str, float]] = {}
        self.lost: dict[str, float] = {}
        """Lost workers, with when they went silent."""

    def restarted(self, name: str) -> bool:
        """Whether `name`'s beats come from another process than at the last check(); changes nothing."""
        last = self._beats.get(name)
        if last is None:
            return False
        beat = self.control.get_if_set(control_keys.heartbeat(name))
        return beat is not None and beat.decode().partition(":")[0] != last[0].partition(":")[0]

    def finished(self, name: str) -> None:
        """`name` reported its input done: one that was lost came back, even if it finished before a new beat."""
        if name in self.lost:
            log.warning(
                "%s rejoined and finished, %.1fs after it went silent", name, time.monotonic() - self.lost.pop(name)
            )

    def handed_over(self, name: str) -> None:
        """`name` was lost for good and another worker reads its shard: it is no longer awaited."""
        self.lost.pop(name, None)

    def raise_if_restarted(self, names: Sequence[str]) -> None:
        """Raises PSRestarted if one of `names` (PS) beats from another process than at its last check()."""
        for name in names:
            if self.restarted(name):
                raise PSRestarted(f"{name} was restarted while the chief waited for it")

    def check(self, name: str) -> bool:
        """Whether `name` was restarted since the last check (its beats come from a new process); raises once it
        was lost for longer than worker_rejoin_timeout_s."""
        now = time.monotonic()
        if self.started is None:
            self.started = now
        found = self.control.get_if_set(control_keys.heartbeat(name))
        beat = found.decode() if found is not None else None
        last = self._beats.get(name)
        if beat is not None and (last is None or beat != last[0]):
            self._beats[name] = (beat, now)
            restarted = last is not None and beat.partition(":")[0] != last[0].partition(":")[0]
            if last is not None and restarted:
                log.warning("%s was restarted, %.1fs after its previous run's last beat", name, now - last[1])
            if name in self.lost:
                log.warning("%s rejoined, %.1fs after it went silent", name, now - self.lost.pop(name))
            return restarted
        seen = last[1] if last is not None else self.started
        silent = now - seen
        limit = self.strategy.heartbeat_timeout_s if last is not None else self.strategy.startup_timeout_s
        if name not in self.lost and silent > limit:
            self.lost[name] = seen
            goes_on = self.strategy.mode == "async" or self.strategy.lost_worker_policy == "continue"
            log.warning(
                "%s is lost: no heartbeat for %.1fs; %s, waiting up to %.0fs for it to be restarted and rejoin",
                name,
                silent,
                "training goes on without it" if goes_on else "its steps wait for it (lost_worker_policy 'wait')",
                self.strategy.worker_rejoin_timeout_s,
            )
        if name in self.lost and now - self.lost[name] > self.strategy.worker_rejoin_timeout_s:
            raise RoleFailedError(
                f"{name} was lost {now - self.lost[name]:.0f}s ago (no heartbeat) and was not restarted within "
                f"worker_rejoin_timeout_s={self.strategy.worker_rejoin_timeout_s:g}s; the job was stopped"
            )
        return False
