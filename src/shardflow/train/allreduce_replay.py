"""What an all-reduce worker put on the chief's control plane and a restarted chief needs, kept and put again: a
restarted chief's control service starts empty. A thread of the worker, on a connection of its own, finds a new
chief's id (`allreduce/chief`), puts again the job's start, its group generation, its resume point, its input
positions of the hand-overs still in flight, its last progress report and (worker:0) the state it handed over that
the chief has not confirmed saved; then `allreduce/live/<role>`, from which the chief adopts the running group
(train/allreduce_chief.py)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from shardflow.cluster import control_keys
from shardflow.cluster.control_keys import Key
from shardflow.cluster.control_plane import ControlPlane
from shardflow.train import allreduce_state, job_keys
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.job_keys import InputState, LiveWorker, StateNotice
from shardflow.train.role_context import RoleContext

log = logging.getLogger(__name__)

_LOOK_EVERY_S = 0.5
"""How often the thread looks whether the chief's control service is a new one."""


class Replay:
    """One worker's keys a restarted chief needs; each `put` through it is kept (the latest value of each key) and
    put again on a chief that lost it. Safe to use from the worker's training thread."""

    def __init__(self, role: RoleContext) -> None:
        self.role, self.name = role, role.task.name
        self._live_key = job_keys.allreduce_live(self.name)
        self._lock = threading.Lock()
        self._kept: dict[str, bytes] = {}
        self._forming: dict[str, bytes] = {}
        """The rendezvous keys this worker wrote for the generation of the group it forms (cluster/dist_store.py)."""
        self._positions: dict[int, str] = {}
        """Hand-over number -> its kept position key: only the last two can be in flight."""
        self._state: tuple[int, list[bytes]] | None = None
        """worker:0's hand-over not confirmed saved, and its state's chunks (allreduce_state.encode)."""
        self._joined = False
        self._generation, self._forming_now = -1, False
        self._next_hand_over = 1
        self._step = -1
        """worker:0's global step (`at_step`): only for the restarted chief's log."""
        self._control = ControlPlane(role.control.address, timeout_s=role.control.timeout_s)
        self._stopped = threading.Event()
        self._chief = role.control.get(control_keys.ALLREDUCE_CHIEF, waiting_for="the chief to start")
        """The chief for which everything kept was put."""
        with self._lock:
            self._announce(role.control)
        self._thread = threading.Thread(target=self._run, name="allreduce-replay", daemon=True)
        self._thread.start()

    def put(self, key: Key[Any], value: Any) -> None:
        """`key` set to `value` on the control plane, and kept."""
        with self._lock:
            self._kept[key.name] = key.encode(value)  # kept first: a restart between the two misses nothing
            self.role.control.put(key, value)

    def set_joined(self, generation: int) -> None:
        """The last generation of the group this worker joined (control_keys.allreduce_joined), kept; the rendezvous
        keys of the one before are no longer."""
        with self._lock:
            self._forming.clear()
            self._generation, self._forming_now = generation, True
            name = control_keys.allreduce_joined(self.name)
            self._kept[name] = str(generation).encode()
            self.role.control.set(name, str(generation))
            self._announce(self.role.control)

    def set_rendezvous(self, name: str, value: bytes) -> None:
        """A rendezvous key of the generation being formed, set and kept: a chief restarted amid the rendezvous
        gets it again, and the forming goes on."""
        with self._lock:
            self._forming[name] = value
            self.role.control.set(name, value)

    def keep(self, key: Key[Any], value: Any) -> None:
        """Another role's key this worker read (the job's start): put again on a restarted chief."""
        with self._lock:
            self._kept[key.name] = key.encode(value)

    def put_position(self, n: int, value: InputState) -> None:
        """This worker's input position of hand-over `n`; that of hand-over n-2 is handled for sure (worker:0 waits
        for it to be saved before it sends n-1) and no longer kept."""
        key = job_keys.allreduce_position(n, self.name)
        with self._lock:
            old = self._positions.pop(n - 2, None)
            if old is not None:
                self._kept.pop(old, None)
            self._positions[n] = key.name
        self.put(key, value)

    def send_state(self, n: int, state: ModelState, *, checkpoint: bool, final: bool, evaluate: bool = False) -> None:
        """worker:0's hand-over `n` of `state`, its chunks and its notice, kept until `confirmed`. A state of at most
        WINDOW chunks goes whole before its notice; a larger one is streamed after it, the chief reading it as it
        comes. A chief restarted meanwhile gets everything kept again, and the stream from its start."""
        chunks = allreduce_state.encode(state)
        notice = StateNotice(
            step=state.step,
            num_chunks=len(chunks),
            scalars=state.scalars,
            checkpoint=checkpoint,
            final=final,
            sender=os.getpid(),
            evaluate=evaluate,
        )
        key = job_keys.allreduce_checkpoint(n)
        with self._lock:
            self._state = (n, chunks)
            self._kept[key.name] = key.encode(notice)
            if self._put_whole(self.role.control):
                return
            self.role.control.put(key, notice)
            self._stream(self.role.control)

    def confirmed(self, n: int) -> None:
        """worker:0 read that the chief saved hand-over `n`: its state is no longer kept."""
        with self._lock:
            if self._state is not None and self._state[0] == n:
                self._state = None
            self._kept.pop(job_keys.allreduce_checkpoint(n).name, None)
            self._next_hand_over = n + 1

    def at_step(self, step: int) -> None:
        """worker:0 trains at global step `step`, as a restarted chief logs it."""
        self._step = step

    def mark_joined(self) -> None:
        """This worker trains in a formed group: a restarted chief must adopt it."""
        with self._lock:
            self._joined, self._forming_now = True, False
            self._announce(self.role.control)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2 * _LOOK_EVERY_S)
        self._control.close()

    def _announce(self, control: ControlPlane) -> None:
        live = LiveWorker(
            chief=self._chief,
            joined=self._joined,
            generation=self._generation,
            forming=self._forming_now,
            next_hand_over=self._next_hand_over,
            step=self._step,
        )
        control.put(self._live_key, live)

    def _run(self) -> None:
        while not self._stopped.wait(_LOOK_EVERY_S):
            try:
                if self._new_chief(self._control):
                    self._put_again()
            except (RuntimeError, OSError, ValueError):  # the chief is gone for good, or stop() closed the connection
                return

    def _new_chief(self, control: ControlPlane) -> str | None:
        """The id of a chief started since everything kept was put, if any (a restarted one sets it first)."""
        chief = (control.get_if_set(control_keys.ALLREDUCE_CHIEF) or b"").decode()
        return chief if chief and chief != self._chief else None

    def _put_again(self) -> None:
        with self._lock:
            if not self._new_chief(self._control):  # the training thread's stream found the restart first
                return
            self._put_again_on(self._control)
            if self._state is not None and len(self._state[1]) > allreduce_state.WINDOW:
                self._stream(self._control)

    def _put_again_on(self, control: ControlPlane) -> None:
        """Everything kept, on a restarted chief's control service, then this worker's `allreduce/live` key; the
        lock held. What a stream cut short left there goes first: the chief reads nothing before that key. A larger
        state than a window is streamed after (`_stream`)."""
        chief = self._new_chief(control)
        assert chief is not None
        log.warning("%s: the chief was restarted; it puts again what the chief needs of it", self.name)
        self._chief = chief
        notice = None
        if self._state is not None:
            n, chunks = self._state
            allreduce_state.forget(control, f"checkpoint/{n}", len(chunks))
            notice = job_keys.allreduce_checkpoint(n).name
        # The job's start last, after this worker's live key: a worker restarted with the chief reads the start
        # first, then the live keys to learn the group's generation (allreduce_group.generation_to_join).
        start = {job_keys.ALLREDUCE_START.name, job_keys.RESTORE_ITERATORS.name}
        for name, data in [*self._kept.items(), *self._forming.items()]:
            if name != notice and name not in start:
                control.set(name, data)
        report = self.role.last_report
        if report is not None:
            control.put(job_keys.progress(self.name), report)
        if notice is not None and not self._put_whole(control):
            control.set(notice, self._kept[notice])
        self._announce(control)
        for name in start & self._kept.keys():
            control.set(name, self._kept[name])

    def _put_whole(self, control: ControlPlane) -> bool:
        """Put the kept state whole, then its notice, where it fits the window (no wait for the chief: a notice
        there says its state is whole, see allreduce_worker.py `_sent_whole`); whether it did. The lock held."""
        assert self._state is not None
        n, chunks = self._state
        if len(chunks) > allreduce_state.WINDOW:
            return False
        allreduce_state.stream(control, f"checkpoint/{n}", chunks, reader_gone=lambda: False)
        notice = job_keys.allreduce_checkpoint(n).name
        control.set(notice, self._kept[notice])
        return True

    def _stream(self, control: ControlPlane) -> None:
        """The kept state's chunks to the chief, from the first, again each time the chief is restarted meanwhile;
        the lock held."""
        assert self._state is not None
        n, chunks = self._state

        def chief_restarted() -> bool:
            return self._new_chief(control) is not None

        while not allreduce_state.stream(control, f"checkpoint/{n}", chunks, reader_gone=chief_restarted):
            self._put_again_on(control)
