"""What the chief does while the workers train: watch them, checkpoint, evaluate, capture, summarise."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.cluster.launcher import RoleExit
from shardflow.comm.errors import DeadlineExceeded
from shardflow.profile import spans
from shardflow.ps.admin import PSAdmin, StatusReply
from shardflow.train import job_keys
from shardflow.train.checkpoints.saved_tables import saved_tables
from shardflow.train.eval_history import EvalHistory, SideCarStopping
from shardflow.train.heartbeat import Heartbeats, PSRestarted
from shardflow.train.job import JobConfig, RoleFailedError
from shardflow.train.job_keys import Handover, ProgressReport
from shardflow.train.profiling import ChiefProfiler
from shardflow.train.progress import ProgressDisplay
from shardflow.train.role_context import RoleContext
from shardflow.train.summaries import Summaries

if TYPE_CHECKING:
    from shardflow.train.checkpoints.manager import CheckpointManager
    from shardflow.train.checkpoints.model_state import ModelState
    from shardflow.train.checkpoints.restore import Recovery
    from shardflow.train.preemption import Preemption

log = logging.getLogger(__name__)

_POLL_S = 0.05
_PS_POLL_S = 0.25
_SLOW_POLL_S = 1.0


class ChiefLoop:
    """Runs until every worker is done; everything periodic the chief does meanwhile lives here."""

    def __init__(
        self,
        job: JobConfig,
        role: RoleContext,
        client: PSAdmin,
        model: torch.nn.Module,
        profiler: ChiefProfiler,
        checkpoints: CheckpointManager,
        start_step: int,
        heartbeats: Heartbeats,
        failures: Sequence[RoleExit] = (),
        recovery: Recovery | None = None,
    ) -> None:
        self.job, self.role, self.client, self.model = job, role, client, model
        self.recovery = recovery
        self.failures = failures
        self.profiler = profiler
        self.checkpoints = checkpoints
        self.control: ControlPlane = role.control
        self.workers = [f"worker:{i}" for i in range(role.num_workers)]
        self.capture_roles = [t.name for t in role.spec.tasks() if t.type in ("chief", "ps", "worker")]
        # A side-car evaluator follows checkpoints; otherwise the chief evaluates inline.
        self.eval_spec = None if role.spec.num("evaluator") else job.eval_spec
        self.started = time.monotonic()
        self.global_step = start_step
        self.progress: dict[str, ProgressReport] = {}
        self.history = EvalHistory(job.model_dir, start_step) if self.eval_spec is not None else None
        """The inline evaluations of the training so far, this chief's and its predecessors' (train/eval_history)."""
        self.side_car = SideCarStopping.of(job.model_dir, job.eval_spec, inline=self.eval_spec is not None)
        """Early stopping on the side-car evaluator's evaluations."""
        self.stopped_early = False
        self.preempted = False
        self.last_eval_time = time.monotonic()
        self.eval_snapshot: int | None = None
        """The step of the snapshot a time-based evaluation asked for, until it is evaluated."""
        self.summaries = Summaries(
            job.model_dir,
            save_summary_steps=job.save_summary_steps,
            workers=self.workers,
            learning_rate=job.optimizer.learning_rate,
        )
        self.heartbeats = heartbeats
        """The same that `client` asks between slices of a wait: a PS restarted meanwhile never answers, so the wait
        ends, and _watch_servers restores every PS."""
        self.handed_over: dict[str, str] = {}
        """Workers lost for good whose remaining shards another worker reads (see _hand_over), to whom."""
        self.training_s = 0.0
        """Seconds from the start of training until the workers were done, the final checkpoint aside."""
        self.display = ProgressDisplay(job.train_spec.max_steps, job.train_spec.epochs, start_step)
        self._ps_stats: list[dict[str, Any]] = []

    @property
    def eval_history(self) -> list[dict[str, Any]]:
        """Every inline evaluation of the training that led here: {"global_step", "elapsed_s", "metrics"}."""
        return self.history.entries if self.history is not None else []

    @property
    def generation(self) -> int:
        """How many times every PS was restored after one was lost (train/checkpoints/restore.py)."""
        return self.recovery.generation if self.recovery is not None else 0

    def run(self, preemption: Preemption | None = None) -> tuple[ModelState, Path]:
        """Until every worker is done and the final checkpoint is saved; or, once `preemption` is requested, until
        they finished their step in flight (waiting at most half the grace period: the other half is the final
        checkpoint's and the exit's). Returns the final state and where it was saved."""
        self.started = time.monotonic()  # evaluation times count from the start of training, not start-up
        next_ps_poll = next_slow = time.monotonic()
        stop_waiting_at = float("inf")
        try:
            while True:
                done = self._watch_workers()
                now = time.monotonic()
                if (done or now >= stop_waiting_at) and (final := self._save_final()) is not None:
                    return final
                if preemption is not None and not self.preempted and self._preempt(preemption, now >= next_ps_poll):
                    stop_waiting_at = now + preemption.remaining_s() / 2
                if now >= next_ps_poll:
                    next_ps_poll = now + _PS_POLL_S
                    self._poll_servers()
                if now >= next_slow:
                    next_slow = now + _SLOW_POLL_S
                    self._stop_if_the_evaluator_says()
                    self.profiler.pick_up_request()
                    self.profiler.collect(self.capture_roles, timeout_s=10.0)
                    self.summaries.training(self.global_step, self.progress, self._ps_stats)
                    self.display.update(self.global_step, self.progress)
                time.sleep(_POLL_S)
        finally:
            # The workers' final reports, however short the run.
            self.summaries.training(self.global_step, self.progress, self._ps_stats, final=True)
            self.display.update(self.global_step, self.progress)
            self.display.close()

    def _save_final(self) -> tuple[ModelState, Path] | None:
        """Once the workers are done: checkpoint the snapshots the PS took since the last poll, then the final state
        every PS holds now. None if a PS was restarted meanwhile, even during the save: the next watch restores every
        PS, the workers train again from there, and this is tried again once they are done."""
        self.training_s = time.monotonic() - self.started
        try:
            replies = self.client.status()
            if not all(reply.initialized for reply in replies):
                return None
            self.global_step = replies[0].step  # the final summaries' step
            self.checkpoints.save_snapshots(replies, self._evaluate_snapshot)
            return self.checkpoints.save_final(self.preempted)
        except PSRestarted as restarted:
            log.warning("%s as training ended; every PS is restored next, and the workers finish again", restarted)
            return None

    def _preempt(self, preemption: Preemption, ask_roles: bool) -> bool:
        """Whether this process got SIGTERM or (when `ask_roles`) another role told that it did; if so, end training
        at the current step, as early stopping does: the PS drop later updates and tell the workers to stop."""
        if not preemption.requested and ask_roles:
            for task in self.role.spec.tasks():
                key = control_keys.preempted(task.name)
                if task.type != "chief" and self.control.is_set(key):
                    preemption.request(f"{self.control.get(key, waiting_for=task.name)} to {task.name}")
                    break
        if not preemption.requested:
            return False
        self.preempted = True
        self._stop_training()
        log.warning(
            "preempted by %s at global step %d: checkpointing and ending the job within %.0fs",
            preemption.reason,
            self.global_step,
            preemption.remaining_s(),
        )
        return True

    # -- workers ----------------------------------------------------------------------------------

    def _watch_servers(self) -> None:
        """A PS that was restarted holds nothing: restore every PS (train/checkpoints/restore.py), and again while
        another was restarted meanwhile, even during the restore, until none was. One lost for good (no beat within
        worker_rejoin_timeout_s) fails the job."""
        restarted = self._restarted_servers()
        while restarted and self.recovery is not None:
            try:
                state = self.recovery.restore(restarted[0], self.global_step)
                self.global_step = state.step
                self.checkpoints.restored(state.step)
                self.eval_snapshot = None  # the PS took none since
                self._tell_restored()
            except PSRestarted as again:
                log.warning("%s; every PS is restored again", again)
                restarted = self._restarted_servers() or restarted
                continue
            restarted = self._restarted_servers()

    def _tell_restored(self) -> None:
        """What a restore does not carry: that training ends at the current step (preempted, or stopped early), and
        which workers are lost (lost_worker_policy "continue")."""
        if self.preempted or self.stopped_early:
            self.client.stop()
        if self.job.strategy.lost_worker_policy == "continue":
            for name in self.heartbeats.lost:
                if name in self.workers:
                    self.client.lost(int(name.rpartition(":")[2]))

    def _stop_if_the_evaluator_says(self) -> None:
        if self.side_car is None or self.stopped_early or not self.side_car.says_stop():
            return
        self.stopped_early = True
        self._stop_training()

    def _stop_training(self) -> None:
        """Every PS ends training at one step, the furthest one's (ps/admin.py `PSAdmin.stop`). One restarted
        meanwhile is told again once every PS is restored (`_tell_restored`)."""
        try:
            self.global_step = self.client.stop()
        except PSRestarted as restarted:
            log.warning("%s as the chief ended training; every PS is restored next, then told", restarted)

    def _restarted_servers(self) -> list[str]:
        """The PS restarted since the last check (their beats come from a new process)."""
        return [name for name in (f"ps:{k}" for k in range(self.role.num_ps)) if self.heartbeats.check(name)]

    def _watch_workers(self) -> bool:
        """Read progress reports and heartbeats; fail on a reported failure or a worker lost for good; True once
        every worker's last report (of the current recovery generation) says it is done."""
        if self.failures:
            raise RoleFailedError(f"{self.failures[0].describe()}; the job was stopped")
        self._watch_servers()
        all_done = True
        for name in self.workers:
            # One round trip per key (this runs 20 times a second).
            failure = self.control.get_if_set(control_keys.failed(name))
            if failure is not None:
                raise RoleFailedError(f"{name} failed: {failure.decode()}")
            progress = self.control.read_if_set(job_keys.progress(name))
            if progress is not None:
                self.progress[name] = progress
            report = self.progress.get(name)
            if report is not None and report.done and report.generation == self.generation:
                self.heartbeats.finished(name)
                continue
            all_done = False
            if name in self.handed_over:
                continue  # its adopter beats for it
            try:
                self._check_worker(name)
            except RoleFailedError:
                if not self._can_hand_over():
                    raise
                self._hand_over(name)
        return all_done

    def _check_worker(self, name: str) -> None:
        """Its heartbeat (see Heartbeats.check). Under lost_worker_policy "continue" the PS learn when it is lost:
        steps complete without it until it rejoins."""
        was_lost = name in self.heartbeats.lost
        try:
            self.heartbeats.check(name)
        finally:
            if not was_lost and name in self.heartbeats.lost and self.job.strategy.lost_worker_policy == "continue":
                try:
                    self.client.lost(int(name.rpartition(":")[2]))
                except PSRestarted as restarted:  # told again once every PS is restored (`_tell_restored`)
                    log.warning("%s as the chief told it %s is lost; every PS is restored next", restarted, name)

    def _can_hand_over(self) -> bool:
        """A lost worker's shard can go to another in async mode with a known number of epochs: the adopter reads
        it as that worker (its index and step count), so the PS apply each of its steps once, whoever sends it."""
        return self.job.strategy.mode == "async" and self.job.train_spec.epochs is not None

    def _hand_over(self, lost: str) -> None:
        adopters = [
            w for w in self.workers if w != lost and w not in self.heartbeats.lost and w not in self.handed_over
        ]
        if not adopters:
            raise RoleFailedError(f"{lost} was lost for good and no worker is left to read its shard")
        # The one furthest along finishes its own shard first.
        adopter = max(adopters, key=lambda w: self.progress[w].local_step if w in self.progress else 0)
        self.handed_over[lost] = adopter
        self.heartbeats.handed_over(lost)
        mine = [name for name, to in self.handed_over.items() if to == adopter]
        self.control.put(job_keys.handover(adopter), Handover(workers=tuple(mine)))
        log.warning(
            "%s did not come back within worker_rejoin_timeout_s=%gs: %s reads the rest of its shard once its own is "
            "done (every record is still applied once)",
            lost,
            self.job.strategy.worker_rejoin_timeout_s,
            adopter,
        )

    # -- checkpoints and evaluation ---------------------------------------------------------------

    def _poll_servers(self) -> None:
        try:
            # A lost PS answers nothing: the heartbeats tell (see _watch_servers); meanwhile polls go unanswered.
            # Short, so a PS that does not answer delays the chief's watch of the others by little.
            strategy = self.job.strategy
            replies = self.client.status(timeout_s=min(strategy.request_timeout_s, strategy.heartbeat_timeout_s / 4))
            self._checkpoint_and_evaluate(replies)
        except DeadlineExceeded as error:
            log.info("status poll unanswered: %s", error)
        except PSRestarted as restarted:
            log.warning("%s; every PS is restored next", restarted)

    def _checkpoint_and_evaluate(self, replies: list[StatusReply]) -> None:
        self.global_step = replies[0].step
        self._ps_stats = [r.stats for r in replies]
        self.checkpoints.poll(replies, self._evaluate_snapshot)
        self._evaluate_if_due()

    def _evaluate_snapshot(self, state: ModelState) -> None:
        """Evaluate a snapshot the checkpoints hand over (CheckpointManager.save_snapshots) at a multiple of its
        step count, exactly there however late the chief looks; or the one a time-based evaluation asked for."""
        every_eval = self.eval_spec.every_n_steps if self.eval_spec is not None else None
        asked = state.step == self.eval_snapshot
        if asked:
            self.eval_snapshot = None
        if (asked or (every_eval is not None and state.step % every_eval == 0)) and not self.stopped_early:
            self.model.load_state_dict(state.params, strict=False)  # parameters only; buffers stay
            self._evaluate_and_maybe_stop(state)

    def _evaluate_if_due(self) -> None:
        """Time-based evaluation: of a snapshot every PS takes at one step, as for a time-based checkpoint (async
        PS are a few pushes apart at any moment: their state now is of no one step, nor are their tables' files)."""
        spec = self.eval_spec
        if spec is None or spec.every_n_secs is None or self.stopped_early or self.eval_snapshot is not None:
            return
        if time.monotonic() - self.last_eval_time >= spec.every_n_secs:
            self.eval_snapshot = self.checkpoints.request_snapshot(checkpoint=False)

    def _evaluate_and_maybe_stop(self, state: ModelState) -> None:
        assert self.eval_spec is not None
        with saved_tables(self.model, state, self.job.model_dir):  # the sf.nn tables' rows of the same step
            self.evaluate(state.step)
        stopping = self.eval_spec.early_stopping
        if stopping is not None:
            assert self.history is not None
            if stopping.should_stop(self.history.values(stopping.metric)):
                self.stopped_early = True
                self._stop_training()

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the parameters now loaded in the chief's model, and record the result."""
        assert self.eval_spec is not None
        self.last_eval_time = time.monotonic()
        with self.profiler.recorder.span(spans.EVAL, step):
            metrics = self.job.evaluate(self.model, self.eval_spec)
        assert self.history is not None
        self.history.add(step, time.monotonic() - self.started, metrics)
        self.summaries.evaluation(step, metrics)
        return metrics
