"""A role's heartbeat: a beat every second on the control plane, from a thread and a connection of its own, from
the role's start to its end; the chief watches them (chief_loop.py Heartbeats)."""

from __future__ import annotations

import os
import threading

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane


class Heartbeat:
    """Beats every `interval_s` while the role runs: a step of any length, or a long start-up, is never taken for a
    lost role, and a restarted role's beats carry its new pid."""

    def __init__(self, name: str, control: ControlPlane, interval_s: float = 1.0) -> None:
        """Beats as role `name` on a connection of its own to the control plane `control` reaches."""
        self._key = control_keys.heartbeat(name)
        self._control = ControlPlane(control.address, timeout_s=control.timeout_s)
        self._interval_s = interval_s
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
