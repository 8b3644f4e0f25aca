"""The chief's role, in phases: start (place the variables, restore the latest checkpoint) or adopt the live PS,
initialise them, run the chief loop (train/chief_loop.py) while the workers train, finish (the final checkpoint
and evaluation, the end of the job)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardflow.cluster import control_keys
from shardflow.cluster.launcher import RoleExit
from shardflow.comm.client import Client
from shardflow.comm.security import job_credentials
from shardflow.nn.modules import table_specs
from shardflow.ps.admin import PSAdmin, StatusReply
from shardflow.ps.connection import PSConnection
from shardflow.ps.placement import Placement, place
from shardflow.ps.sparse import sparse_variables
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train import job_keys
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.manager import CheckpointManager, snapshot_every
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.restore import Recovery, restore_latest
from shardflow.train.checkpoints.saved_tables import saved_tables
from shardflow.train.checkpoints.servers import TableSetup, fetch_state, init_servers
from shardflow.train.chief_loop import ChiefLoop
from shardflow.train.heartbeat import Heartbeats, PSRestarted
from shardflow.train.job import JobConfig
from shardflow.train.job_keys import RecoveryNotice
from shardflow.train.preemption import Preemption
from shardflow.train.profiling import ChiefProfiler, remove_job_file, write_job_file
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import TrainResult

log = logging.getLogger(__name__)


def _resumed_at(restored: ModelState | None, worker: str) -> int:
    """The worker's own step count when this run started: it goes on counting from the checkpoint's, and a
    run's result counts the steps of that run."""
    if restored is None or not restored.ps_progress:
        return 0
    return min(int(progress.get("worker_steps", {}).get(worker, 0)) for progress in restored.ps_progress)


def run_chief(
    job: JobConfig,
    role: RoleContext,
    *,
    failures: Sequence[RoleExit] = (),
    on_connect: Callable[[PSConnection | None], None] = lambda _: None,
    preemption: Preemption | None = None,
) -> TrainResult:
    """Run the job to its end and return what it did. `failures` lists roles the local launcher saw exit with an
    error (the loop fails on the first); `on_connect` is told the client to the PS while it exists. Once
    `preemption` is requested, training ends at the current step and the result says `preempted`."""
    preemption = preemption or Preemption(job.strategy.termination_grace_s)
    started = time.monotonic()
    # The chief is the only role that saves, and none of its saves has started yet.
    store.clean(job.model_dir)
    heartbeats = Heartbeats(role.control, job.strategy)
    start = _start_or_adopt(job, role, heartbeats)
    restored_from = store.latest(job.model_dir) if start.restored is not None and not start.adopted else None
    on_connect(start.admin)
    # Before the PS are initialised: each reads a capture asked for up front when its init arrives.
    profiler = ChiefProfiler(role.control, role.spec.address(role.task).rpartition(":")[0], job.model_dir)
    if job.profile_steps is not None:
        profiler.request(*job.profile_steps, ops=job.profile_ops)
    apply = _initialise(job, role, start)
    write_job_file(job, role)
    loop = _chief_loop(job, role, start, apply, profiler, heartbeats, failures)
    role.control.set(control_keys.READY, "1")
    try:
        final = loop.run(preemption)
        _say_why_it_ended(job, loop, restored_from, start.step, final[0].step)
        finished = _finish(job, role, start.admin, loop, profiler, preemption, final)
    finally:
        remove_job_file(job.model_dir)
        loop.summaries.close()
        profiler.close()
        on_connect(None)
    return _result(finished, loop, start, started, loop.training_s)


@dataclass(frozen=True, kw_only=True)
class _Start:
    """Where training starts: the PS connected, and the state they hold or are initialised with."""

    admin: PSAdmin
    model: torch.nn.Module
    placement: Placement
    restored: ModelState | None
    """The live PS's state (adopted), or the latest checkpoint's; None: a fresh start."""
    adopted: bool
    """This chief was restarted and every PS kept its state: training goes on from it."""
    replies: list[StatusReply]
    """Every PS's status when the chief started: their snapshots taken for the chief that died."""
    generation: int
    """The recovery generation (train/checkpoints/restore.py)."""

    @property
    def step(self) -> int:
        return self.restored.step if self.restored else 0


def _start_or_adopt(job: JobConfig, role: RoleContext, heartbeats: Heartbeats) -> _Start:
    """Connect to every PS and see what they hold: a restarted chief adopts the live PS when every one kept its
    state; else training starts from the latest checkpoint, or from the model's initial values."""
    control = role.control
    strategy = job.strategy
    model = job.build_model()
    placement = place(model.named_parameters(), role.num_ps, strategy.partitioner, sparse_variables(model))
    addresses = [
        control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to start") for k in range(role.num_ps)
    ]
    admin = PSAdmin(
        Client("chief", credentials=job_credentials()),
        addresses,
        placement,
        model,
        timeout_s=strategy.request_timeout_s,
        # A PS restarted while the chief waits for it never answers: the wait ends, and the chief loop restores.
        interrupt=functools.partial(heartbeats.raise_if_restarted, [f"ps:{k}" for k in range(role.num_ps)]),
    )
    replies = admin.status(timeout_s=strategy.startup_timeout_s)
    generation = max(reply.generation for reply in replies)
    live = all(reply.initialized for reply in replies)
    restored: ModelState | None
    if live:
        # This chief was restarted and every PS kept its state: go on from it, exactly where training stands.
        restored = fetch_state(admin)
        model.load_state_dict(restored.params, strict=False)
        log.warning(
            "the chief was restarted: resumed from the live parameter servers at global step %d (recovery %d)",
            restored.step,
            generation,
        )
    else:
        restored = restore_latest(job, model, role)
        if any(reply.initialized for reply in replies):
            # A restarted chief, and a PS restarted too: every PS goes back to the latest checkpoint.
            generation += 1
    if generation:
        # Workers started from now on (and those that missed a restore) learn the current recovery generation.
        step = restored.step if restored else 0
        control.put(job_keys.RECOVERY, RecoveryNotice(generation=generation, step=step, lost="chief"))
    return _Start(
        admin=admin,
        model=model,
        placement=placement,
        restored=restored,
        adopted=live,
        replies=replies,
        generation=generation,
    )


def _initialise(job: JobConfig, role: RoleContext, start: _Start) -> ApplyConfig:
    """Initialise every PS (unless adopted) with the optimizer, the update rule and the starting state; then the
    workers find the placement."""
    strategy = job.strategy
    apply = ApplyConfig(
        mode=strategy.mode,
        num_workers=role.num_workers,
        replicas_to_aggregate=strategy.replicas_to_aggregate,
        max_staleness=strategy.max_staleness,
        max_steps=job.train_spec.max_steps,
        snapshot_every_n_steps=snapshot_every(job, role),
        hold_timeout_s=strategy.request_timeout_s,
    )
    if not start.adopted:
        init_servers(
            start.admin,
            job.optimizer,
            apply,
            start.restored,
            timeout_s=strategy.startup_timeout_s,
            generation=start.generation,
            tables=TableSetup.of(start.model, job.model_dir, job.full_checkpoint_every),
        )
    role.control.put(job_keys.PLACEMENT, start.placement)
    return apply


def _chief_loop(
    job: JobConfig,
    role: RoleContext,
    start: _Start,
    apply: ApplyConfig,
    profiler: ChiefProfiler,
    heartbeats: Heartbeats,
    failures: Sequence[RoleExit],
) -> ChiefLoop:
    """The chief's loop over training, with its checkpoints and how to restore every PS."""
    model, admin = start.model, start.admin
    specs = table_specs(model)
    checkpoints = CheckpointManager(job, role, admin, start.placement, profiler.recorder, start.step, specs)
    initial = start.restored or ModelState(
        step=0, params={n: p.detach().clone() for n, p in model.state_dict().items()}
    )
    recovery = Recovery(job, role, admin, model, apply, initial, start.generation)
    loop = ChiefLoop(job, role, admin, model, profiler, checkpoints, start.step, heartbeats, failures, recovery)
    if start.adopted:
        # Snapshots the PS took for the chief that died are checkpointed now, oldest first; without any, one is
        # asked for at once: what a PS lost from now on is restored to.
        checkpoints.adopt(start.replies)
    return loop


def _say_why_it_ended(job: JobConfig, loop: ChiefLoop, restored_from: Path | None, start: int, end: int) -> None:
    """A run whose workers' inputs ended before any step (a finished job run again), or before the max_steps it
    was given alone, says so."""
    if loop.preempted or loop.stopped_early:
        return
    spec = job.train_spec
    trained = any(report.first_loss is not None for report in loop.progress.values())
    if not trained and restored_from is not None:
        reason = f"epochs={spec.epochs} reached" if spec.epochs is not None else "the input of every worker ended"
        log.warning(
            "restored %s at global step %d: training is already done (%s); nothing to train",
            restored_from.name,
            start,
            reason,
        )
    elif spec.epochs is None and spec.max_steps is not None and end < spec.max_steps:
        log.warning(
            "training ended at global step %d, before max_steps=%d: the input of every worker ended",
            end,
            spec.max_steps,
        )


@dataclass(frozen=True, kw_only=True)
class _Finished:
    state: ModelState
    """The final state, checkpointed at `path`."""
    path: Path
    metrics: dict[str, float]
    captures: list[Path]


def _finish(
    job: JobConfig,
    role: RoleContext,
    admin: PSAdmin,
    loop: ChiefLoop,
    profiler: ChiefProfiler,
    preemption: Preemption,
    final: tuple[ModelState, Path],
) -> _Finished:
    """The final evaluation, of the `final` checkpoint (its state and where it was saved); then every PS and role
    is told the job is over, and the captures are collected."""
    control = role.control
    state, path = final
    loop.model.load_state_dict(state.params, strict=False)  # what a final inline evaluation evaluates
    metrics: dict[str, float] = {}
    if loop.eval_spec is not None:
        last = loop.eval_history[-1] if loop.eval_history else None
        if last and last["global_step"] == state.step:
            metrics = last["metrics"]
        elif not loop.preempted:  # no time for a final evaluation within the grace period
            with saved_tables(loop.model, state, job.model_dir):  # the sf.nn tables' rows of the final step
                metrics = loop.evaluate(state.step)
    try:
        admin.shutdown()
    except PSRestarted as restarted:
        # The final checkpoint is saved: a PS restarted since needs no restore, only the end of the job, next.
        log.info("%s after the final checkpoint; the control plane tells it the job is over", restarted)
    control.set(control_keys.SHUTDOWN, "1")
    if role.spec.num("evaluator") and job.eval_spec is not None and not loop.preempted:
        evaluated = control.read(job_keys.EVAL_FINAL, waiting_for="the evaluator's last evaluation", timeout_s=600)
        metrics = evaluated.metrics
    profiler.collect(loop.capture_roles, timeout_s=min(30.0, preemption.remaining_s() / 4), final=True)
    return _Finished(state=state, path=path, metrics=metrics, captures=list(profiler.completed))


def _result(finished: _Finished, loop: ChiefLoop, start: _Start, started: float, training_s: float) -> TrainResult:
    progress = loop.progress
    first = [p.first_loss for p in progress.values() if p.first_loss is not None]
    final_losses = [p.loss for p in progress.values() if p.first_loss is not None]
    state, captures = finished.state, finished.captures
    return TrainResult(
        global_step=state.step,
        metrics=finished.metrics,
        checkpoint=str(finished.path),
        first_loss=sum(first) / len(first) if first else None,
        final_loss=sum(final_losses) / len(final_losses) if final_losses else None,
        elapsed_s=_since_process_start(started),
        training_s=training_s,
        start_step=start.step,
        worker_steps={name: p.local_step - _resumed_at(start.restored, name) for name, p in progress.items()},
        ps_stats=state.stats,
        profile_dir=str(captures[-1]) if captures else None,
        eval_history=loop.eval_history,
        stopped_early=loop.stopped_early,
        preempted=loop.preempted,
        failed_checkpoint_saves=loop.checkpoints.num_failed_saves,
    )


def _since_process_start(fallback_started: float) -> float:
    """Wall seconds since this process started, its imports and the cluster's start-up included (TrainResult's
    elapsed_s); since `fallback_started` (a monotonic time) where the process's start time cannot be read."""
    import psutil

    try:
        return max(0.0, time.time() - float(psutil.Process().create_time()))
    except psutil.Error:
        return time.monotonic() - fallback_started
