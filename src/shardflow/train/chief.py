"""The chief: places variables, initialises (or restores) the PS, runs the chief loop, writes the final checkpoint."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from shardflow.cluster import control_keys
from shardflow.cluster.launcher import RoleExit
from shardflow.comm.client import Client
from shardflow.comm.security import SECRET_FILE, is_loopback, job_credentials, write_secret
from shardflow.ps.apply import ApplyConfig
from shardflow.ps.checkpointing import ModelState, fetch_state, init_servers
from shardflow.ps.client import ParameterClient
from shardflow.ps.placement import place
from shardflow.ps.sparse import sparse_variables
from shardflow.train import checkpoint
from shardflow.train.chief_loop import ChiefLoop
from shardflow.train.job import JobConfig
from shardflow.train.preemption import Preemption
from shardflow.train.profiling import ChiefProfiler
from shardflow.train.recovery import Recovery, restore_latest
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import TrainResult

log = logging.getLogger(__name__)


def _last_checkpoint_step(job: JobConfig) -> int:
    path = checkpoint.latest(job.model_dir)
    return int(json.loads((path / "manifest.json").read_text())["global_step"]) if path is not None else 0


def _resumed_at(restored: ModelState | None, worker: str) -> int:
    """The worker's own step count when this run started: it goes on counting from the checkpoint's, and a
    run's result counts the steps of that run."""
    if restored is None or not restored.ps_progress:
        return 0
    return min(int(progress.get("worker_steps", {}).get(worker, 0)) for progress in restored.ps_progress)


def _snapshot_every(job: JobConfig, role: RoleContext) -> int | None:
    """The PS snapshot at every step that is a checkpoint or an inline evaluation."""
    eval_spec = job.eval_spec
    every_eval = eval_spec.every_n_steps if eval_spec is not None and not role.spec.num("evaluator") else None
    counts = [n for n in (job.save_checkpoints_steps, every_eval) if n]
    return math.gcd(*counts) if counts else None


def run_chief(
    job: JobConfig,
    role: RoleContext,
    *,
    failures: Sequence[RoleExit] = (),
    on_connect: Callable[[ParameterClient | None], None] = lambda _: None,
    preemption: Preemption | None = None,
) -> TrainResult:
    """Run the job to its end and return what it did. `failures` lists roles the local launcher saw exit with an
    error (the loop fails on the first); `on_connect` is told the client to the PS while it exists. Once
    `preemption` is requested, training ends at the current step and the result says `preempted`."""
    preemption = preemption or Preemption(job.strategy.termination_grace_s)
    control = role.control
    strategy = job.strategy
    started = time.monotonic()
    # The chief is the only role that saves, and none of its saves has started yet.
    checkpoint.clean(job.model_dir)
    model = job.build_model()
    placement = place(model.named_parameters(), role.num_ps, strategy.partitioner, sparse_variables(model))
    addresses = [
        control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to start") for k in range(role.num_ps)
    ]
    client = ParameterClient(
        Client("chief", credentials=job_credentials()),
        addresses,
        placement,
        model,
        timeout_s=strategy.request_timeout_s,
    )
    on_connect(client)
    replies = client.status(timeout_s=strategy.startup_timeout_s)
    generation = max(reply.generation for reply in replies)
    live = all(reply.initialized for reply in replies)
    restored: ModelState | None
    if live:
        # This chief was restarted and every PS kept its state: go on from it, exactly where training stands.
        restored = fetch_state(client)
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
        control.set(control_keys.RECOVERY, json.dumps({"generation": generation, "step": step, "lost": "chief"}))
    start_step = restored.step if restored else 0
    apply = ApplyConfig(
        mode=strategy.mode,
        num_workers=role.num_workers,
        replicas_to_aggregate=strategy.replicas_to_aggregate,
        max_staleness=strategy.max_staleness,
        max_steps=job.train_spec.max_steps,
        snapshot_every_n_steps=_snapshot_every(job, role),
        hold_timeout_s=strategy.request_timeout_s,
    )
    # Before the PS are initialised: each reads a capture asked for up front when its init arrives.
    profiler = ChiefProfiler(control, role.spec.address(role.task).rpartition(":")[0], job.model_dir)
    if job.profile_steps is not None:
        profiler.request(*job.profile_steps, ops=job.profile_ops)
    if not live:
        init_servers(
            client, job.optimizer, apply, restored, timeout_s=strategy.startup_timeout_s, generation=generation
        )
    control.set(control_keys.PLACEMENT, json.dumps(placement.to_json()))
    job_file = _write_job_file(job, role)
    manifest = {
        "placement": placement.to_json(),
        "mode": strategy.mode,
        "num_workers": role.num_workers,
        "num_ps": role.num_ps,
        "optimizer": job.optimizer.to_json(),
    }
    initial = restored or ModelState(step=0, params={n: p.detach().clone() for n, p in model.state_dict().items()})
    recovery = Recovery(job, role, client, model, apply, initial, generation)
    loop = ChiefLoop(job, role, client, model, profiler, manifest, start_step, failures, recovery)
    loop.generation = generation
    if live:
        # Snapshots the PS took for the chief that died are checkpointed now, oldest first; without any, one is
        # asked for at once: what a PS lost from now on is restored to.
        loop.last_snapshot_step = _last_checkpoint_step(job)
        if not any(reply.snapshots for reply in replies):
            loop.request_snapshot(start_step)
    control.set(control_keys.READY, "1")
    try:
        training_started = time.monotonic()
        loop.run(preemption)
        training_s = time.monotonic() - training_started
        state = fetch_state(client)
        model.load_state_dict(state.params, strict=False)  # what a final inline evaluation evaluates
        path = checkpoint.save_state(
            job.model_dir, state, {**manifest, "ps_stats": state.stats}, keep=job.keep_checkpoint_max
        )
        if loop.preempted:
            log.warning("preempted: checkpoint %s at global step %d; the next run resumes from it", path, state.step)
        metrics: dict[str, float] = {}
        if loop.eval_spec is not None:
            last = loop.eval_history[-1] if loop.eval_history else None
            if last and last["global_step"] == state.step:
                metrics = last["metrics"]
            elif not loop.preempted:  # no time for a final evaluation within the grace period
                metrics = loop.evaluate(state.step)
        client.shutdown()
        control.set(control_keys.SHUTDOWN, "1")
        if role.spec.num("evaluator") and job.eval_spec is not None and not loop.preempted:
            final = control.get(control_keys.EVAL_FINAL, waiting_for="the evaluator's last evaluation", timeout_s=600)
            metrics = json.loads(final)["metrics"]
        profiler.collect(loop.capture_roles, timeout_s=min(30.0, preemption.remaining_s() / 4), final=True)
        captures = profiler.completed
    finally:
        job_file.unlink(missing_ok=True)
        (job.model_dir / SECRET_FILE).unlink(missing_ok=True)  # the job is over: so is its secret
        loop.summaries.close()
        profiler.close()
        client.close()
        on_connect(None)
    progress = loop.progress
    first = [p["first_loss"] for p in progress.values() if p.get("first_loss") is not None]
    final_losses = [p["loss"] for p in progress.values() if p.get("local_step")]
    return TrainResult(
        global_step=state.step,
        metrics=metrics,
        checkpoint=str(path),
        first_loss=sum(first) / len(first) if first else None,
        final_loss=sum(final_losses) / len(final_losses) if final_losses else None,
        elapsed_s=_since_process_start(started),
        training_s=training_s,
        start_step=start_step,
        worker_steps={name: int(p["local_step"]) - _resumed_at(restored, name) for name, p in progress.items()},
        ps_stats=state.stats,
        profile_dir=str(captures[-1]) if captures else None,
        eval_history=loop.eval_history,
        stopped_early=loop.stopped_early,
        preempted=loop.preempted,
    )


def _write_job_file(job: JobConfig, role: RoleContext) -> Path:
    """Where a tool finds the running job (`shardflow profile capture MODEL_DIR`)."""
    job.model_dir.mkdir(parents=True, exist_ok=True)
    path = job.model_dir / "job.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"control": role.control.address, "pid": os.getpid()}))
    os.replace(tmp, path)
    secret = job_credentials().secret
    if secret is not None and is_loopback(f"tcp://{role.control.address}"):
        # A local job's secret is made by its launcher; a tool of the same user reads it here (mode 0600). A real
        # cluster's secret is never written into model_dir, which may be shared storage.
        write_secret(job.model_dir / SECRET_FILE, secret)
    return path


def _since_process_start(fallback_started: float) -> float:
    """Wall seconds since this process started, its imports and the cluster's start-up included (TrainResult's
    elapsed_s); since `fallback_started` (a monotonic time) where the process's start time cannot be read."""
    import psutil

    try:
        return max(0.0, time.time() - float(psutil.Process().create_time()))
    except psutil.Error:
        return time.monotonic() - fallback_started
