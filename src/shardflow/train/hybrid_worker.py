"""A worker of `sf.HybridStrategy`: an all-reduce worker (train/allreduce_worker.py) whose model's `sf.nn` tables
live on the PS. Each step looks its batch's rows up on the PS, pushes their gradients to the PS (and waits for
every PS to take them) before it all-reduces the dense gradients with the other workers: so once a global step's
all-reduce is done, every worker's rows of it are with the PS.

Each push carries the global step + 1 as the worker's local step: a step the group dropped and trains again (a
worker was lost) pushes the same one, and a PS that had it takes it once (ps/server.py `_repeated`). For a
checkpoint, worker:0 has every PS snapshot its tables while no worker pushes past that step (the others wait for
its `hybrid/snapshot/<n>` before their next push); the chief saves those rows with the dense state."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from shardflow.cluster import control_keys
from shardflow.cluster.control_keys import Key
from shardflow.data.torch_edge import to_torch
from shardflow.nn import backend
from shardflow.profile.recorder import SpanRecorder
from shardflow.ps import protocol
from shardflow.ps.client import ParameterClient, PushRequest
from shardflow.ps.protocol import StatusReply
from shardflow.train import allreduce_group, allreduce_state, job_keys
from shardflow.train.allreduce_gradients import GradientReducer
from shardflow.train.allreduce_group import GroupLostError, NoSurvivorsError
from shardflow.train.allreduce_replay import Replay
from shardflow.train.allreduce_worker import JobAborted, _Trainer, run_allreduce_worker
from shardflow.train.checkpoints import store
from shardflow.train.input import InputPosition, Lookahead
from shardflow.train.job import JobConfig
from shardflow.train.job_keys import ResumePoint, TablesSnapshot
from shardflow.train.profiling import RoleProfiler
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import InputContext
from shardflow.train.strategy import AllReduceStrategy, HybridStrategy
from shardflow.train.worker import connect_parameters

log = logging.getLogger(__name__)


_RECOVERY_CHECK_S = 0.2
"""How often a step looks for a PS recovery that its waits did not meet: the chief may begin one while every PS
answers on time (a PS restarted, then restored, before a request found it empty)."""


class PSRecovery(RuntimeError):
    """A PS was lost: the chief restores every PS from the latest checkpoint, and the workers go back to it."""


class _RecoveryWhileForming(Exception):
    """A PS was lost while the group waited for workers to form it: this worker goes back first, then forms it."""


def run_hybrid_worker(job: JobConfig[AllReduceStrategy], role: RoleContext) -> None:
    """The worker's main, as an all-reduce worker's with its tables on the PS."""
    run_allreduce_worker(job, role, _HybridTrainer)


class _HybridTrainer(_Trainer):
    """An all-reduce worker's run whose `sf.nn` lookups and row gradients go to the PS."""

    def __init__(
        self,
        job: JobConfig[AllReduceStrategy],
        role: RoleContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        start_position: dict[str, Any] | None,
        step: int,
        generation: int,
        replay: Replay,
    ) -> None:
        assert isinstance(job.strategy, HybridStrategy)
        self.sync = job.strategy.sparse_mode == "sync"
        self.told_done = False
        """Whether the PS were told this worker's input is done (sync: they no longer wait for its rows)."""
        self.snapshot_due: Key[TablesSnapshot] | None = None
        """A non-leader's: the snapshot of the last hand-over, to wait for before its next push."""
        recovery = role.control.read_if_set(job_keys.HYBRID_RECOVERY)
        self.recovery = recovery.generation if recovery is not None else 0
        """The PS recovery generation this worker's state belongs to (a restarted worker joins the current one)."""
        self.recovering = False
        """A wait for a PS found a newer recovery: the step in progress is given up at its collective."""
        if recovery is not None and not role.control.is_set(job_keys.hybrid_restart(recovery.generation)):
            # Restarted while the chief restores the PS: it waits for this worker to stop too, so this one takes
            # part in the recovery as the others do (`_join` rolls back first), rather than wait for them to form.
            self.recovery, self.recovering = recovery.generation - 1, True
        self.rolled_back = False
        self.step_batches: list[Any] = []
        """This step's batches (gradient accumulation): the first one's forward sends the others' lookups ahead."""
        self.step_begun = False
        """Whether this step's push was begun: its first batch begins it, the others' rows' gradients join it."""
        self.recovery_checked = time.monotonic()
        """When the step's collective last looked for a recovery itself."""
        self.params = _connect(job, role, model, self._interrupt)
        try:
            super().__init__(job, role, model, optimizer, start_position, step, generation, replay)
            # The PS were restored since the job began: they take a new process's pushes once it rejoined (a worker
            # of before rejoined as it rolled back; one restarted during a restore rejoins as it rolls back). A PS lost
            # meanwhile begins another recovery, which this worker meets at its first step's collective.
            if self.recovery and not self.recovering:
                with contextlib.suppress(PSRecovery):
                    self.params.rejoin()
        except BaseException:
            self.params.close()
            raise
        # Read one batch ahead: its rows are looked up while this step computes.
        if isinstance(self.position, InputPosition):
            self.position = Lookahead(self.position, to_torch)

    def run(self, profiler: RoleProfiler) -> None:
        try:
            assert self.params.tables is not None
            with backend.installed(self.params.tables):
                self.train(profiler)
                while self._restored_after_the_end():
                    self.train(profiler)
            self.hooks.end(self.report.local_step, self.step)
        finally:
            tables = self.params.tables
            if tables is not None and tables.not_prefetched:
                log.info(
                    "%s: %d sf.nn table lookups were made when forward asked, not sent ahead",
                    self.name,
                    tables.not_prefetched,
                )
            self.params.close()

    def _trained_to_the_end(self) -> None:
        """The `end` hooks wait for the end of the job (`run`): a PS lost before the final state is saved sends this
        worker back to train on, and they run once, after its true last step."""

    def _restored_after_the_end(self) -> bool:
        """Once this worker's part of the final state is handed over: wait for the end of the job (False); or, where
        a PS is lost before the chief saved that state (it cannot: the PS's rows of it are gone), go back with every
        worker to the state every PS is restored to and form the group again (True), to train on from there."""
        while not self.recovering:
            if self.role.control.set_within(control_keys.SHUTDOWN, 1.0, waiting_for="the end of the job"):
                return False
            with contextlib.suppress(PSRecovery):
                self._check_recovery()
        log.warning("%s: a parameter server was lost before the final state was saved; training goes on", self.name)
        self._form_again()
        return True

    def _interrupt(self) -> None:
        """Between slices of a wait for a PS: the job ended, or a PS was lost (the chief restores them all). A worker
        of the group lost meanwhile does not end a lookup or worker:0's snapshot (they ask the PS alone): the step's
        collective meets the loss."""
        if self.role.control.is_set(control_keys.SHUTDOWN):
            raise JobAborted(f"{self.name}: the chief ended the job while this worker waited for a parameter server")
        self._check_recovery()

    def _interrupt_in_collective(self) -> None:
        """`_interrupt`, and a worker of the group lost (sync: the PS wait for its rows of the step, which it pushes
        again once restarted and the group formed again): PeerLostError, and the step is dropped."""
        self._interrupt()
        peers = getattr(self, "peers", None)
        if peers is not None:
            peers.check("the parameter servers to take its table rows")

    def _check_recovery(self) -> None:
        """Raise PSRecovery once the chief began restoring the PS after one was lost."""
        recovery = self.role.control.read_if_set(job_keys.HYBRID_RECOVERY)
        if recovery is not None and recovery.generation > self.recovery:
            self.recovering = True
            raise PSRecovery(f"{self.name}: {recovery.lost} was lost; the job goes back to its latest checkpoint")

    def _join(self, generation: int, *, restarted: bool, timeout_s: float) -> GradientReducer:
        """As an all-reduce worker's; where a PS was lost, first back to the state every PS is restored to, also
        when the loss comes while the group waits for a worker to form it (which waits for the restore)."""
        while True:
            try:
                if self.recovering:
                    self._roll_back()
                    restarted = False  # with the checkpoint's state, as every other worker
                reducer = super()._join(generation, restarted=restarted, timeout_s=timeout_s)
                break
            except (_RecoveryWhileForming, PSRecovery):  # (another) PS lost meanwhile: back to its restore
                continue
            except NoSurvivorsError:  # the dense state is gone with every worker: back to the checkpoint too
                self._ask_recovery()
                generation = allreduce_group.generation_to_join(self.role)
        self.peers.interrupt = self._check_recovery  # a collective waiting for a worker that rolled back ends
        return reducer

    def _ask_recovery(self) -> None:
        """Every worker was lost at once: ask the chief to go back to the latest checkpoint, every PS and worker, as
        after a PS loss, and wait until it began (then `_check_recovery` raised)."""
        strategy = self.job.strategy
        self.role.control.set(job_keys.hybrid_workers_lost(self.recovery), "1")
        log.warning("%s: every worker was lost at once; the job goes back to its latest checkpoint", self.name)
        deadline = time.monotonic() + strategy.request_timeout_s
        while not self.recovering:
            if time.monotonic() > deadline:
                raise GroupLostError(
                    f"{self.name}: every worker was lost at once, and the chief did not go back to the latest "
                    f"checkpoint within request_timeout_s={strategy.request_timeout_s:g}s"
                )
            try:
                self._check_recovery()
            except PSRecovery:
                return
            time.sleep(0.05)

    def _forming(self) -> None:
        try:
            self._check_recovery()
        except PSRecovery as recovery:  # not a RuntimeError: the all-reduce worker's _join must not retry on it
            raise _RecoveryWhileForming(str(recovery)) from None

    def _roll_back(self) -> None:
        """Say this worker stopped, then load the state the chief restored every PS to, and its input position."""
        control, strategy = self.role.control, self.job.strategy
        recovery = control.read(job_keys.HYBRID_RECOVERY, waiting_for="the chief's recovery notice")
        generation = recovery.generation
        control.set(job_keys.hybrid_stopped(generation, self.name), "1")
        restart = control.read(
            job_keys.hybrid_restart(generation),
            waiting_for=f"the chief to restore the parameter servers after {recovery.lost} was lost",
            timeout_s=strategy.worker_rejoin_timeout_s + strategy.startup_timeout_s,
        )
        self.optimizer.state.clear()
        if restart.checkpoint is not None:
            state, _ = store.load_state(store.directory(self.job.model_dir) / restart.checkpoint)
            allreduce_state.restore(self.model, self.optimizer, state)
        else:  # no checkpoint yet: the job's initial values
            self.model.load_state_dict(self.job.build_model().state_dict())
        position = InputPosition(
            self.job.train_spec,
            InputContext(self.role.num_workers, self.index),
            restart.positions.get(self.name, self.start_position),
        )
        control.put(job_keys.allreduce_resume(self.name), ResumePoint(position=position.get_state(), batches_applied=0))
        self.position = Lookahead(position, to_torch)
        self.step, self.checkpoints = restart.step, restart.next_hand_over - 1
        self.hand_over_step, self.hand_over_saves = -1, False
        self.batches_applied = [0] * self.role.num_workers
        self.had_batch = [True] * self.role.num_workers
        self.input_done = self.told_done = False
        self.snapshot_due = None
        endpoints = [
            control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to start")
            for k in range(len(self.params.peers))
        ]
        self.params.reconnect(endpoints)  # a restarted PS serves elsewhere
        self.params.rejoin()  # every PS takes this worker's pushes again
        self.recovery, self.recovering, self.rolled_back = generation, False, True
        log.warning("%s went back to global step %d, where every PS was restored", self.name, self.step)

    def _next_batch(self) -> Any | None:
        if self.rolled_back:  # the batch of the step given up is read again from the restored position, or not
            self.retry, self.rolled_back = None, False
        return super()._next_batch()

    def _next_batches(self) -> list[Any]:
        self.step_begun = False  # a step retried begins anew, its rows' gradients of before dropped
        self.step_batches = super()._next_batches()
        return self.step_batches

    def _forward_backward(self, batch: Any, recorder: SpanRecorder, scale: float = 1.0) -> float:
        """As an all-reduce worker's, its rows looked up on the PS. The first batch of a step begins its push and
        sends the lookups of the next step's first batch ahead (every batch of this step is read already); the
        others' rows' gradients join the same push, their rows looked up when forward asks: as of this step (sync:
        no PS applies it before this worker's push)."""
        params = self.params
        tables = params.tables
        assert tables is not None
        if not self.step_begun:
            self.step_begun = True
            params.local_step = self.step  # begin_push counts this step's: global step + 1, the same when retried
            if self.sync:
                params.assume_steps(self.step)
            params.begin_push(self.step)
            # The rows of the step's other batches as of this step (sync: ps:k is at it already, and applies it only
            # once this worker pushed); async: as they are when each lookup arrives.
            tables.prefetch_later(self.step_batches[1:], [self.step if self.sync else 0] * len(params.peers))
            upcoming = self.position.peek() if isinstance(self.position, Lookahead) else None
            if upcoming is not None:
                # Sync: the rows once this step's are applied; async: as they are when the lookup arrives.
                tables.prefetch(upcoming, [self.step + 1 if self.sync else 0] * len(params.peers))
        tables.set_batch(batch)
        try:
            return super()._forward_backward(batch, recorder, scale)
        except PSRecovery:  # a lookup found the PS lost: given up at the step's collective
            return float("nan")

    def _collective(self, had_batch: bool, mine: list[float], recorder: SpanRecorder) -> list[float]:
        """The rows' gradients to every PS, taken, before the dense all-reduce. A worker without a batch pushes
        nothing; in sync mode it tells the PS once that its input is done, so that they apply the others' rows."""
        now = time.monotonic()
        if now - self.recovery_checked >= _RECOVERY_CHECK_S:  # one the waits did not meet (its PS answer on time)
            self.recovery_checked = now
            with contextlib.suppress(PSRecovery):
                self._check_recovery()
        if self.recovering:
            raise PSRecovery(f"{self.name}: the step of global step {self.step} is given up: a PS was lost")
        self.params.interrupt = self._interrupt_in_collective
        try:
            if had_batch:
                self._await_snapshot()
                schedule = self.job.optimizer.schedule
                from_workers = schedule and schedule.from_workers
                learning_rate = self.job.optimizer.learning_rate(self.step) if from_workers else None
                pushed = self.params.push(PushRequest(learning_rate=learning_rate))
                self.params.wait_push(pushed, load_params=False)
            elif self.sync and not self.told_done:
                self.params.done()
                self.told_done = True
        finally:
            self.params.interrupt = self._interrupt
        return super()._collective(had_batch, mine, recorder)

    def _hand_over(self, *, final: bool, checkpoint: bool, again: bool = False, evaluate: bool = False) -> None:
        """As an all-reduce worker's, with the tables' rows of the same step: worker:0 has every PS snapshot them
        first, and the others push again only once they are."""
        n = self.checkpoints + (0 if again else 1)
        key = job_keys.hybrid_snapshot(self.recovery, n)
        control = self.role.control
        if self.leader and not control.is_set(key.name):
            try:
                step = _snapshot(self.params, self._await_recovery)
                self.replay.put(key, TablesSnapshot(step=step))  # kept for a restarted chief
            except PSRecovery:
                # Not handed over: the next step's collective gives up (after the final one, `run` goes back), and
                # the chief awaits state n again.
                return
        super()._hand_over(final=final, checkpoint=checkpoint, again=again, evaluate=evaluate)
        if not self.leader:
            self.snapshot_due = key

    def _await_recovery(self) -> None:
        """A PS was restarted and is not restored yet: the chief begins a recovery once it sees the new process; wait
        for it (PSRecovery)."""
        limit_s = self.job.strategy.request_timeout_s
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self._check_recovery()
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: a parameter server was restarted and not restored within {limit_s:g}s")

    def _await_snapshot(self) -> None:
        """Wait for worker:0's snapshot of the last hand-over before pushing past it; a worker of the group lost
        meanwhile raises PeerLostError (the group is formed again, and a restarted worker:0 takes the snapshot)."""
        key, self.snapshot_due = self.snapshot_due, None
        if key is None:
            return
        strategy = self.job.strategy
        limit_s = strategy.worker_rejoin_timeout_s + strategy.request_timeout_s
        deadline = time.monotonic() + limit_s
        while not self.role.control.set_within(key.name, 0.5, waiting_for="worker:0's snapshot of the sf.nn tables"):
            self.snapshot_due = key  # still due if the group breaks here
            self._interrupt_in_collective()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} waited {limit_s:g}s for worker:0's snapshot of the sf.nn tables")
        self.snapshot_due = None


def _connect(
    job: JobConfig[AllReduceStrategy], role: RoleContext, model: torch.nn.Module, interrupt: Any
) -> ParameterClient:
    """A client to every PS for the model's `sf.nn` tables only (the chief places no dense variable on them)."""
    params = connect_parameters(job, role, model, interrupt, lanes=False)
    if params.tables is None:
        params.close()
        raise ValueError("HybridStrategy: the model has no sf.nn tables; train it with sf.AllReduceStrategy")
    return params


def _snapshot(params: ParameterClient, await_recovery: Callable[[], None]) -> int:
    """Every PS snapshots its tables now (no worker pushes meanwhile); their step, alike on every PS. A PS restarted
    and not restored yet holds nothing to snapshot: `await_recovery` waits for the chief's recovery (PSRecovery)."""
    replies = params.exchange([protocol.Status()] * len(params.peers))
    statuses = [StatusReply.decode(header, peer) for (header, _), peer in zip(replies, params.peers, strict=True)]
    if not all(status.initialized for status in statuses):
        await_recovery()
    steps = {status.step for status in statuses}
    if len(steps) != 1:
        raise RuntimeError(f"the parameter servers are at different steps {sorted(steps)} with no push in flight")
    step = steps.pop()
    params.broadcast(protocol.SnapshotAt(step=step))
    return step
