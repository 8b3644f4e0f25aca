"""Preemption: SIGTERM, as Kubernetes and Slurm send it, ends the job at the current global step, checkpointed,
with every process gone within `ParameterServerStrategy.termination_grace_s`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane, ControlPlaneError
from shardflow.cluster.launcher import PREEMPTED_EXIT_CODE
from shardflow.train.role_context import RoleContext

_POLL_S = 0.1


class Preemption:
    """Whether this process was asked to end early, why, and by when it must be gone.

    The SIGTERM handler only records the time; the training loops act on it, and a daemon thread ends the process
    at the deadline if they have not. A second SIGTERM ends the process at once, as does SIGINT (KeyboardInterrupt)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.reason = ""
        self.requested_at: float | None = None
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        self._previous_sigint: Callable[[int, FrameType | None], Any] | int | None = None
        self._users_ctrl_c: Callable[[], bool] = lambda: True
        self._installed = False
        self._closed = threading.Event()

    def install(
        self,
        on_request: Callable[[Preemption], None] = lambda _: None,
        ctrl_c: Callable[[], bool] | None = None,
    ) -> Preemption:
        """Handle SIGTERM from now on (only the main thread can; elsewhere only `request` preempts). With `ctrl_c`,
        SIGINT alike while `ctrl_c()` says it is the user's (the process the user started: Ctrl-C checkpoints as
        SIGTERM does; a second one ends it at once); otherwise SIGINT raises KeyboardInterrupt as usual (the
        launcher's way of interrupting the chief when a role failed). Once preempted, `on_request` runs in a daemon
        thread (it may do I/O), which then enforces the deadline."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            if ctrl_c is not None:
                self._users_ctrl_c = ctrl_c
                self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        threading.Thread(target=self._watch, args=(on_request,), daemon=True, name="shardflow-preemption").start()
        return self

    def uninstall(self) -> None:
        """Back to the SIGTERM handling before `install`; the deadline no longer applies."""
        self._closed.set()
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            # None means the previous handler was set outside Python and cannot be put back.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
        if self._installed and signal.getsignal(signal.SIGINT) == self._on_sigint:
            previous = self._previous_sigint
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        self._installed = False

    def request(self, reason: str) -> None:
        """Preempt, if not already: the deadline is `grace_s` from now."""
        if self.requested_at is None:
            self.reason = reason
            self.requested_at = time.monotonic()

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def remaining_s(self) -> float:
        """Seconds left until the deadline; infinite while not preempted."""
        if self.requested_at is None:
            return float("inf")
        return max(0.0, self.requested_at + self.grace_s - time.monotonic())

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        self.request("SIGTERM")

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if not self._users_ctrl_c():
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: KeyboardInterrupt
        print("shardflow: Ctrl-C: checkpointing and ending the job (Ctrl-C again to stop at once)", file=sys.stderr)
        self.request("Ctrl-C")

    def _watch(self, on_request: Callable[[Preemption], None]) -> None:
        while self.requested_at is None:
            if self._closed.wait(_POLL_S):
                return
        on_request(self)
        if not self._closed.wait(self.remaining_s()):
            exit_now(f"still running {self.grace_s:g}s after {self.reason} (termination_grace_s); exiting")


def exit_now(message: str | None) -> None:
    """End this process with the status SIGTERM would have given it, after `message` if any. Callable from any
    thread: it writes straight to stderr, taking no lock the main thread may hold."""
    if message is not None:
        with contextlib.suppress(OSError):
            os.write(sys.stderr.fileno(), f"shardflow: {message}\n".encode())
    os._exit(PREEMPTED_EXIT_CODE)


def tell_chief(role: RoleContext) -> Callable[[Preemption], None]:
    """What a role other than the chief does on SIGTERM: ask the chief to preempt the whole job, and keep working
    until the job is over. With the job already over or the chief unreachable, there is nothing to wait for."""

    def notify(preemption: Preemption) -> None:
        name, address = role.task.name, role.control.address
        try:
            # A connection of its own: the main thread keeps using role.control meanwhile.
            # The chief answers in milliseconds; a dead one must not hold the role past the launcher's grace.
            control = ControlPlane(address, timeout_s=min(2.0, preemption.grace_s))
            try:
                over = control.is_set(control_keys.SHUTDOWN)
                if not over:
                    control.set(control_keys.preempted(name), preemption.reason)
            finally:
                control.close()
        except (ControlPlaneError, RuntimeError) as error:
            exit_now(f"{name}: {preemption.reason}, and the chief's control plane at {address} is gone ({error})")
            return
        if over:  # the launcher ending a finished job's roles: nothing to say
            exit_now(None)
        print(
            f"{name}: {preemption.reason}; asked the chief to checkpoint and end the job "
            f"within {preemption.grace_s:g}s",
            file=sys.stderr,
            flush=True,
        )

    return notify
