"""A worker's progress report to the chief: its steps, losses and input waits, about once a second."""

from __future__ import annotations

import math
import time

from shardflow.train import job_keys
from shardflow.train.job_keys import ProgressReport
from shardflow.train.role_context import RoleContext

_REPORT_EVERY_S = 1.0
_SUMMARY_KEEP_S = 30.0


class Report:
    """The worker's progress, sent to the chief about once a second (also its heartbeat)."""

    def __init__(
        self, role: RoleContext, local_step: int = 0, save_summary_steps: int = 100, generation: int = 0
    ) -> None:
        self.role = role
        self.save_summary_steps = save_summary_steps
        # Loss sum and count per summary interval of global steps (by the step its batch was computed on): the
        # chief writes each interval's mean once every worker is past it.
        self.summary_losses: dict[int, list[float]] = {}
        self.summary_interval = -1
        """The interval of this worker's latest step; it adds to no earlier one."""
        self._completed: dict[int, float] = {}
        self.started = self.last_sent = time.monotonic()
        self.local_step = local_step
        self._first_local_step = local_step
        self.epoch = 0
        self.first_loss: float | None = None
        self.last_loss = 0.0
        self.input_wait_ns = 0
        self.generation = generation
        """The recovery generation this run of the worker belongs to: the chief counts a "done" of the current one."""

    def step(self, loss: float, epoch: int, base_step: int) -> None:
        """One step of this worker, computed on the parameters of global step `base_step`."""
        self.local_step += 1
        self.last_loss = loss
        self.epoch = epoch
        if self.first_loss is None:
            self.first_loss = loss
        interval = base_step // self.save_summary_steps
        if math.isfinite(loss):
            total = self.summary_losses.setdefault(interval, [0.0, 0])
            total[0] += loss
            total[1] += 1
        # An interval is complete once this worker is past it (its base steps only grow); it is reported for
        # _SUMMARY_KEEP_S more, so the chief sees it even when it was busy (a checkpoint, an evaluation) meanwhile.
        now = time.monotonic()
        for k in [k for k in self.summary_losses if k < interval]:
            if now - self._completed.setdefault(k, now) > _SUMMARY_KEEP_S:
                del self.summary_losses[k], self._completed[k]
        self.summary_interval = interval

    def input_waited(self, ns: int) -> None:
        """This worker waited `ns` nanoseconds for its input."""
        self.input_wait_ns += ns

    def due(self) -> bool:
        return time.monotonic() - self.last_sent >= _REPORT_EVERY_S

    def send(self, done: bool = False) -> None:
        self.last_sent = time.monotonic()
        elapsed = self.last_sent - self.started
        self.role.last_report = ProgressReport(
            local_step=self.local_step,
            epoch=self.epoch,
            first_loss=self.first_loss,
            loss=self.last_loss,
            steps_per_s=(self.local_step - self._first_local_step) / elapsed if elapsed > 0 else 0.0,
            input_wait_share=self.input_wait_ns / 1e9 / elapsed if elapsed > 0 else 0.0,
            time=time.time(),
            done=done,
            generation=self.generation,
            summary_losses={k: (total, int(count)) for k, (total, count) in self.summary_losses.items()},
            summary_interval=self.summary_interval,
        )
        self.role.control.put(job_keys.progress(self.role.task.name), self.role.last_report)
