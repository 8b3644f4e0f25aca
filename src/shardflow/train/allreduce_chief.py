"""The chief of `sf.AllReduceStrategy`: it restores the latest checkpoint (a PS job's too) and hands it to the
workers, watches them (failures, heartbeats, progress), saves the states worker:0 hands over in the PS strategy's
checkpoint format, evaluates the final one and ends the job. It takes no part in the workers' group."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardflow.cluster import control_keys
from shardflow.cluster.launcher import RoleExit
from shardflow.nn.modules import table_specs
from shardflow.ps.embeddings.spec import TableSpec
from shardflow.ps.sparse import sparse_variables
from shardflow.train import allreduce_state, job_keys
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.manager import CheckpointSaveError
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.restore import restore_latest
from shardflow.train.eval_history import EvalHistory, SideCarStopping
from shardflow.train.job import JobConfig, RoleFailedError, is_hybrid
from shardflow.train.job_keys import (
    AllReduceStart,
    GlobalStep,
    LiveWorker,
    ProgressReport,
    RestoredPositions,
    Saved,
    StateNotice,
)
from shardflow.train.preemption import Preemption
from shardflow.train.profiling import ChiefProfiler, remove_job_file, write_job_file
from shardflow.train.progress import ProgressDisplay
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import TrainResult
from shardflow.train.strategy import AllReduceStrategy
from shardflow.train.summaries import Summaries

log = logging.getLogger(__name__)

_WAIT_S = 0.2
"""How long the chief's wait for worker:0's next state is held before it looks at the launcher's failures."""
_WATCH_EVERY_S = 1.0
"""How often the chief reads the workers' failures, heartbeats, preemptions and progress on the control plane."""


def run_allreduce_chief(
    job: JobConfig[AllReduceStrategy],
    role: RoleContext,
    *,
    failures: Sequence[RoleExit] = (),
    preemption: Preemption | None = None,
    chief_class: type[_Chief] | None = None,
) -> TrainResult:
    """Run the job to its end and return what it did; a worker that failed (`failures`, from the local launcher, or
    its own report on the control plane) or went silent fails it with RoleFailedError naming it. `chief_class`:
    the chief while the workers train (HybridStrategy's has its tables on the PS); `_Chief` by default."""
    preemption = preemption or Preemption(job.strategy.termination_grace_s)
    started = time.monotonic()
    store.clean(job.model_dir)
    model = job.build_model()
    _check_supported(job, model)
    start = _start_or_adopt(job, role, model)
    # Before the workers train: each picks a capture asked for up front as it starts training.
    profiler = ChiefProfiler(role.control, role.spec.address(role.task).rpartition(":")[0], job.model_dir)
    if job.profile_steps is not None:
        profiler.request(*job.profile_steps, ops=job.profile_ops)
    chief = (chief_class or _Chief)(job, role, model, _Watch(job, role, failures), start, profiler)
    try:
        write_job_file(job, role)  # once the chief put the global step that `shardflow profile capture` reads
        state, path = chief.train(preemption)
        training_s = time.monotonic() - started
        metrics: dict[str, float] = {}
        if chief.eval_spec is not None and not preemption.requested:  # no time for it within the grace period
            last = chief.eval_history[-1] if chief.eval_history else None
            metrics = last["metrics"] if last and last["global_step"] == state.step else chief.evaluate(state)
        timeout_s = min(30.0, preemption.remaining_s() / 4)
        profiler.collect(chief.capture_roles(), timeout_s=timeout_s, final=True)
        if role.spec.num("evaluator") and job.eval_spec is not None and not preemption.requested:
            metrics = _side_car_metrics(role)
    finally:
        remove_job_file(job.model_dir)
        chief.close()
        profiler.close()
    chief.watch.read_progress()
    first_loss, final_loss = _losses(chief.watch.progress)
    return TrainResult(
        global_step=state.step,
        metrics=metrics,
        checkpoint=str(path),
        first_loss=first_loss,
        final_loss=final_loss,
        elapsed_s=time.monotonic() - started,
        training_s=training_s,
        start_step=start.step,
        worker_steps={name: p.local_step for name, p in chief.watch.progress.items()},
        ps_stats=dict(state.stats),  # HybridStrategy: each PS's counters at the final state
        eval_history=chief.eval_history,
        stopped_early=chief.stopped_early,
        preempted=preemption.requested,
        failed_checkpoint_saves=chief.failed_saves,
        profile_dir=str(profiler.completed[-1]) if profiler.completed else None,
    )


class _Chief:
    """The chief while the workers train: it checkpoints and evaluates each state worker:0 hands over, writes the
    summaries, shows the progress, passes a preemption or an early stop on to worker:0, and merges each capture
    once its roles sent their parts."""

    def __init__(
        self,
        job: JobConfig[AllReduceStrategy],
        role: RoleContext,
        model: torch.nn.Module,
        watch: _Watch,
        start: _Start,
        profiler: ChiefProfiler,
    ) -> None:
        self.job, self.role, self.model, self.watch, self.profiler = job, role, model, watch, profiler
        self.eval_spec = None if role.spec.num("evaluator") else job.eval_spec
        """What the chief evaluates while training; None with a side-car evaluator, which follows checkpoints."""
        self.started = time.monotonic()
        self.display = ProgressDisplay(job.train_spec.max_steps, job.train_spec.epochs, start.step)
        self.summaries = Summaries(
            job.model_dir,
            save_summary_steps=job.save_summary_steps,
            workers=watch.workers,
            learning_rate=job.optimizer.learning_rate,
        )
        self.manifest: dict[str, Any] = {
            "placement": None,
            "mode": job.strategy.mode,
            "num_workers": role.num_workers,
            "num_ps": 0,
            "optimizer": job.optimizer.to_json(),
        }
        """What every checkpoint records besides the state, as the PS strategy's (checkpoints/manager.py)."""
        self.table_specs: tuple[TableSpec, ...] = ()
        """The `sf.nn` tables whose rows the PS write into each checkpoint (HybridStrategy's)."""
        self.step = start.step
        role.control.put(job_keys.GLOBAL_STEP, GlobalStep(step=self.step))
        self.awaited = start.next_hand_over
        """The number of the next state of worker:0 this chief saves."""
        self.history = EvalHistory(job.model_dir, start.evaluated_through) if self.eval_spec is not None else None
        """The inline evaluations of the training so far, this chief's and its predecessors' (train/eval_history)."""
        self.side_car = SideCarStopping.of(job.model_dir, job.eval_spec, inline=self.eval_spec is not None)
        """Early stopping on the side-car evaluator's evaluations."""
        self.stopped_early = False
        self.failed_saves = 0

    def train(self, preemption: Preemption) -> tuple[ModelState, Path]:
        """Until the final state: each state worker:0 hands over checkpointed or evaluated (or both), the workers
        watched. The final state and where it was saved."""
        control = self.role.control
        watched = 0.0
        while True:
            n = self.awaited
            notice_key = job_keys.allreduce_checkpoint(n)
            # Held by the control service: no polling while the workers train.
            # Also between states that follow each other closely (a checkpoint every few steps): the workers' health,
            # a preemption and an early stop are not left waiting for a pause in them.
            if time.monotonic() - watched >= _WATCH_EVERY_S or preemption.requested:
                watched = time.monotonic()
                self._watch(preemption)
            if not control.set_within(notice_key.name, _WAIT_S, waiting_for="worker:0's next state"):
                self.watch.check_launcher()
                continue
            notice = control.read(notice_key, waiting_for="worker:0's state")
            state = self._collect(n, notice)
            if state is None:  # worker:0 was lost amid its stream: its restarted process sends it again
                continue
            path = self._save(state, final=notice.final) if notice.checkpoint or notice.final else None
            control.put(job_keys.allreduce_saved(n), Saved(path=str(path) if path is not None else None))
            control.delete(notice_key)
            # A final state that is not saved (HybridStrategy: a PS was lost before; a final checkpoint that cannot
            # be written raised) is not the end: the workers train on from the restore.
            if notice.final and path is not None:
                self.watch.read_progress()
                self.summaries.training(state.step, self.watch.progress, [], final=True)
                return state, path
            every = self.eval_spec.every_n_steps if self.eval_spec is not None else None
            if (notice.evaluate or (every and state.step % every == 0)) and not self.stopped_early:
                self._evaluate_and_maybe_stop(state)
            self.awaited = n + 1

    def _collect(self, n: int, notice: StateNotice) -> ModelState | None:
        return _collect(self.role, n, notice)

    def capture_roles(self) -> list[str]:
        """The roles whose parts of a capture the chief merges."""
        return ["chief", *self.watch.workers]

    def _watch(self, preemption: Preemption) -> None:
        """The workers' failures, heartbeats, preemptions and progress; an end asked for is passed on; a capture
        asked for from outside the job is asked of every role, and merged once their parts arrived."""
        self.watch.check()
        self.watch.pass_on_preemption(preemption)
        if self.side_car is not None and not self.stopped_early and self.side_car.says_stop():
            self.stopped_early = True
        if preemption.requested or self.stopped_early:
            self.role.control.set(control_keys.ALLREDUCE_STOP, "1")
        self.step = _global_step(self.watch.progress, self.display.start_step)
        self.role.control.put(job_keys.GLOBAL_STEP, GlobalStep(step=self.step))
        self.profiler.pick_up_request()
        self.profiler.collect(self.capture_roles(), timeout_s=10.0)
        self.display.update(self.step, self.watch.progress)
        self.summaries.training(self.step, self.watch.progress, [])

    def _save(self, state: ModelState, *, final: bool) -> Path | None:
        """Write `state` as the PS strategy writes its checkpoints. A periodic one that cannot be written is logged
        and counted (None), unless fail_on_save_error; a final one always fails the job."""
        job = self.job
        try:
            return store.save_state(job.model_dir, state, self.manifest, job.keep_checkpoint_max, self.table_specs)
        except OSError as error:
            where = f"checkpoint at global step {state.step} could not be saved in {store.directory(job.model_dir)}"
            if final or job.strategy.fail_on_save_error:
                raise CheckpointSaveError(f"{where}: {error}") from None
            self.failed_saves += 1
            log.warning("%s: %s; training goes on", where, error)
            return None

    def _evaluate_and_maybe_stop(self, state: ModelState) -> None:
        assert self.job.eval_spec is not None
        self.evaluate(state)
        stopping = self.job.eval_spec.early_stopping
        assert self.history is not None
        if stopping is not None and stopping.should_stop(self.history.values(stopping.metric)):
            self.stopped_early = True  # worker:0 reads it within _POLL_EVERY_S; the state after its step is the last
            self.role.control.set(control_keys.ALLREDUCE_STOP, "1")

    def evaluate(self, state: ModelState) -> dict[str, float]:
        """Evaluate `state` in the chief's model and record the result."""
        assert self.job.eval_spec is not None
        self.model.load_state_dict(state.params)
        metrics = self.job.evaluate(self.model, self.job.eval_spec)
        assert self.history is not None
        self.history.add(state.step, time.monotonic() - self.started, metrics)
        self.summaries.evaluation(state.step, metrics)
        return metrics

    @property
    def eval_history(self) -> list[dict[str, Any]]:
        """Every inline evaluation of the training that led here: {"global_step", "elapsed_s", "metrics"}."""
        return self.history.entries if self.history is not None else []

    def close(self) -> None:
        self.display.close()
        self.summaries.close()


def _side_car_metrics(role: RoleContext) -> dict[str, float]:
    """The side-car evaluator's evaluation of the final checkpoint, once it learns the job is over."""
    role.control.set(control_keys.SHUTDOWN, "1")  # the final checkpoint is saved: it is the last one
    return role.control.read(job_keys.EVAL_FINAL, waiting_for="the evaluator's last evaluation", timeout_s=600).metrics


def _check_supported(job: JobConfig[AllReduceStrategy], model: torch.nn.Module) -> None:
    """Raise ValueError for what the all-reduce strategy cannot do yet, naming it and what can."""
    tables = [spec.name for spec in table_specs(model)]
    if tables and not is_hybrid(job):
        raise ValueError(
            f"the model's sf.nn tables {tables} live on parameter servers: train it with sf.ParameterServerStrategy "
            "(AllReduceStrategy all-reduces dense gradients only)"
        )
    sparse = sparse_variables(model)
    if sparse:
        raise ValueError(
            f"{sparse} are sparse embeddings (sparse=True), whose row-sparse gradients AllReduceStrategy does not "
            "all-reduce: make them dense (sparse=False), or train with sf.ParameterServerStrategy"
        )


@dataclass(frozen=True, kw_only=True)
class _Start:
    step: int
    """The global step the run started from."""
    next_hand_over: int
    """The first of worker:0's hand-overs this chief saves."""
    restored: ModelState | None = None
    """The checkpoint the run starts from, if any (the workers load it from model_dir)."""
    adopted: bool = False
    """A restarted chief adopted the live group (nothing restored)."""
    adopted_step: int | None = None
    """The live group's global step when this chief adopted it: the evaluations recorded up to it still hold."""

    @property
    def evaluated_through(self) -> int:
        """The last global step whose evaluations (eval/history.jsonl) belong to the training this chief goes on."""
        return self.adopted_step if self.adopted_step is not None else self.step


def _start_or_adopt(job: JobConfig[AllReduceStrategy], role: RoleContext, model: torch.nn.Module) -> _Start:
    """Where this chief starts: the latest checkpoint (or the model's initial values), handed out to the workers;
    or, restarted while the workers' group trains, the live group, adopted (no checkpoint is restored over it): the
    run's start as the workers kept it, and worker:0's first hand-over not confirmed saved, which it puts again
    (train/allreduce_replay.py)."""
    timeout_s = job.strategy.startup_timeout_s
    chief = uuid.uuid4().hex
    role.control.set(control_keys.ALLREDUCE_CHIEF, chief)
    names = [f"worker:{index}" for index in range(role.num_workers)]
    live = {name: _live(role, name, chief, timeout_s) for name in names}
    if not any(worker.joined for worker in live.values()):
        restored = restore_latest(job, model, role)
        _hand_out(job, role, restored)
        return _Start(step=restored.step if restored is not None else 0, next_hand_over=1, restored=restored)
    leader = live["worker:0"]
    if not leader.joined:
        raise RoleFailedError(
            "the chief was restarted while worker:0 was restarted too: the states it handed over are lost with both "
            "(one role lost at a time is survived); run the job again to resume from its last checkpoint"
        )
    start = role.control.read(job_keys.ALLREDUCE_START, waiting_for="the live workers' start", timeout_s=timeout_s)
    log.warning(
        "the chief was restarted: adopted the live all-reduce group at global step %d; the next state saved is "
        "hand-over %d",
        leader.step,
        leader.next_hand_over,
    )
    return _Start(step=start.step, next_hand_over=leader.next_hand_over, adopted=True, adopted_step=leader.step)


def _live(role: RoleContext, name: str, chief: str, timeout_s: float) -> LiveWorker:
    """Worker `name`'s `allreduce/live` key once it was put for this chief (`chief`, its id): then everything else
    the worker keeps for a chief is there too (train/allreduce_replay.py)."""
    key = job_keys.allreduce_live(name)
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.0, deadline - time.monotonic())
        live = role.control.read(key, waiting_for=f"{name} to start", timeout_s=left)
        if live.chief == chief:
            return live
        if time.monotonic() > deadline:
            raise RoleFailedError(f"{name} did not put again what the restarted chief needs within {timeout_s:g}s")
        time.sleep(_WAIT_S)


def _hand_out(job: JobConfig[AllReduceStrategy], role: RoleContext, restored: ModelState | None) -> None:
    """The state training starts from, for every worker: the restored checkpoint, which each loads from model_dir
    (as a restarted PS does: the control store holds 1 GiB in all), or none (the model's initial values); and each
    worker's input position in it."""
    if restored is None:
        role.control.put(job_keys.ALLREDUCE_START, AllReduceStart(step=0, checkpoint=None))
        return
    path = store.latest(job.model_dir)
    assert path is not None and store.global_step(path) == restored.step  # nothing saves before the start
    role.control.put(job_keys.RESTORE_ITERATORS, RestoredPositions(positions=restored.iterators))
    role.control.put(job_keys.ALLREDUCE_START, AllReduceStart(step=restored.step, checkpoint=path.name))


def _collect(role: RoleContext, n: int, notice: StateNotice) -> ModelState | None:
    """Checkpoint n's state from worker:0 and every worker's input position, removed from the control plane. None,
    with the notice and the chunks removed, where worker:0 was lost amid its stream (a new process beats)."""
    control = role.control

    def sender_gone() -> bool:
        pid = (control.get_if_set(control_keys.heartbeat("worker:0")) or b"").partition(b":")[0]
        return bool(pid) and pid != str(notice.sender).encode()

    name = f"checkpoint/{n}"
    try:
        state = allreduce_state.receive(
            control,
            name,
            notice.num_chunks,
            step=notice.step,
            scalars=notice.scalars,
            waiting_for="worker:0's state",
            delete=True,
            sender_gone=sender_gone,
        )
    except allreduce_state.StreamCut as cut:
        log.warning("%s; waiting for worker:0, restarted, to send state %d again", cut, n)
        allreduce_state.forget(control, name, notice.num_chunks)
        control.delete(job_keys.allreduce_checkpoint(n))
        return None
    for index in range(role.num_workers):
        name = f"worker:{index}"
        key = job_keys.allreduce_position(n, name)
        state.iterators[name] = control.read(key, waiting_for=f"{name}'s input position").position
        control.delete(key)
    return state


class _Watch:
    """The workers as the chief sees them: their progress, their failures and their heartbeats."""

    def __init__(self, job: JobConfig[AllReduceStrategy], role: RoleContext, failures: Sequence[RoleExit]) -> None:
        self.strategy = job.strategy
        self.role = role
        self.failures = failures
        self.workers = [f"worker:{index}" for index in range(role.num_workers)]
        self.progress: dict[str, ProgressReport] = {}
        self.started = time.monotonic()
        self.beats: dict[str, tuple[str, float]] = {}

    def check_launcher(self) -> None:
        """Raise RoleFailedError naming a worker that the local launcher saw fail."""
        if self.failures:
            raise RoleFailedError(f"{self.failures[0].describe()}; the all-reduce group cannot go on without it")

    def check(self) -> None:
        """Raise RoleFailedError naming a worker that failed or whose heartbeat stopped."""
        self.check_launcher()
        control = self.role.control
        now = time.monotonic()
        for name in self.workers:
            failed = control.get_if_set(control_keys.failed(name))
            if failed is not None:
                raise RoleFailedError(f"{name} failed: {failed.decode(errors='replace')}")
            beat = control.get_if_set(control_keys.heartbeat(name))
            last = self.beats.get(name)
            if beat is not None and (last is None or last[0] != beat.decode()):
                self.beats[name] = (beat.decode(), now)
                continue
            # A lost worker is restarted and the others wait worker_rejoin_timeout_s for it: they name it first.
            rejoin_s = self.strategy.heartbeat_timeout_s + self.strategy.worker_rejoin_timeout_s
            since, limit = (last[1], rejoin_s) if last else (self.started, self.strategy.startup_timeout_s)
            if now - since > limit:
                raise RoleFailedError(
                    f"{name} gave no heartbeat for {now - since:.0f}s (limit {limit:g}s): lost; the all-reduce group "
                    "cannot go on without it"
                )
        self.read_progress()

    def pass_on_preemption(self, preemption: Preemption) -> None:
        """A worker sent SIGTERM (a cluster manager's) asks the chief to end the job, checkpointed, as its own
        SIGTERM does."""
        if preemption.requested:
            return
        control = self.role.control
        for name in self.workers:
            key = control_keys.preempted(name)
            if control.is_set(key):
                preemption.request(f"{control.get(key, waiting_for=name)} to {name}")
                log.warning("preempted by %s: checkpointing at the next global step", preemption.reason)
                return

    def read_progress(self) -> None:
        for name in self.workers:
            report = self.role.control.read_if_set(job_keys.progress(name))
            if report is not None:
                self.progress[name] = report


def _global_step(progress: dict[str, ProgressReport], start_step: int) -> int:
    """About the global step, for the display: every worker steps in lockstep."""
    return start_step + max((report.local_step for report in progress.values()), default=0)


def _losses(progress: dict[str, ProgressReport]) -> tuple[float | None, float | None]:
    """The mean over the workers of their first and of their last losses."""
    first = [p.first_loss for p in progress.values() if p.first_loss is not None]
    final = [p.loss for p in progress.values() if p.first_loss is not None]
    return (sum(first) / len(first) if first else None, sum(final) / len(final) if final else None)
