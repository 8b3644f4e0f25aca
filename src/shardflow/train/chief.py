"""The chief: places variables, initialises (or restores) the PS, runs the chief loop, writes the final checkpoint."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardflow.comm.client import Client
from shardflow.ps.apply import ApplyConfig
from shardflow.ps.checkpointing import ModelState, fetch_state, init_servers
from shardflow.ps.client import ParameterClient
from shardflow.ps.placement import place
from shardflow.ps.sparse import sparse_variables
from shardflow.train import checkpoint
from shardflow.train.chief_loop import ChiefLoop
from shardflow.train.input import carry_over
from shardflow.train.profiling import ChiefProfiler
from shardflow.train.specs import EvalSpec, TrainResult, TrainSpec

if TYPE_CHECKING:
    from shardflow.train.estimator import Estimator
    from shardflow.train.roles import RoleContext

log = logging.getLogger(__name__)


def _restore(est: Estimator, model: torch.nn.Module, role: RoleContext) -> ModelState | None:
    """Load the latest checkpoint in model_dir into `model`; tell the workers where their input stood."""
    path = checkpoint.latest(est.model_dir)
    if path is None:
        return None
    state, manifest = checkpoint.load_state(path)
    model.load_state_dict(state.params)
    old_workers = int(manifest.get("num_workers", role.num_workers))
    if old_workers != role.num_workers and state.iterators:
        state.iterators = carry_over(state.iterators, old_workers, role.num_workers)
        log.info(
            "restored %s written by %d workers into %d: the new workers first finish the old shards where they "
            "stopped, through epoch %d, then read their own shards",
            path,
            old_workers,
            role.num_workers,
            next(iter(state.iterators.values()))["epoch"] - 1,
        )
    role.control.set("restore/iterators", json.dumps(state.iterators))
    log.info("restored %s at global step %d", path, state.step)
    return state


def _snapshot_every(est: Estimator, eval_spec: EvalSpec | None, role: RoleContext) -> int | None:
    """The PS snapshot at every step that is a checkpoint or an inline evaluation."""
    every_eval = eval_spec.every_n_steps if eval_spec is not None and not role.spec.num("evaluator") else None
    counts = [n for n in (est.save_checkpoints_steps, every_eval) if n]
    return math.gcd(*counts) if counts else None


def run_chief(est: Estimator, spec: TrainSpec, eval_spec: EvalSpec | None, role: RoleContext) -> TrainResult:
    control = role.control
    strategy = est.strategy
    started = time.monotonic()
    model = est.build_model()
    restored = _restore(est, model, role)
    start_step = restored.step if restored else 0
    placement = place(model.named_parameters(), role.num_ps, strategy.partitioner, sparse_variables(model))
    addresses = [control.endpoint(f"ps/{k}", waiting_for=f"ps:{k} to start") for k in range(role.num_ps)]
    client = ParameterClient(Client("chief"), addresses, placement, model, timeout_s=strategy.request_timeout_s)
    est._live_parameters = client
    apply = ApplyConfig(
        mode=strategy.mode,
        num_workers=role.num_workers,
        replicas_to_aggregate=strategy.replicas_to_aggregate,
        max_staleness=strategy.max_staleness,
        max_steps=spec.max_steps,
        snapshot_every_n_steps=_snapshot_every(est, eval_spec, role),
    )
    init_servers(client, est.optimizer, apply, restored, timeout_s=strategy.startup_timeout_s)
    profiler = ChiefProfiler(control, role.spec.address(role.task).rpartition(":")[0], est.model_dir)
    if est.profile_steps is not None:
        profiler.request(*est.profile_steps, ops=est.profile_ops)
    control.set("placement", json.dumps(placement.to_json()))
    job_file = _write_job_file(est, role)
    manifest = {
        "placement": placement.to_json(),
        "mode": strategy.mode,
        "num_workers": role.num_workers,
        "num_ps": role.num_ps,
        "optimizer": est.optimizer.to_json(),
    }
    loop = ChiefLoop(est, spec, eval_spec, role, client, model, profiler, manifest, start_step)
    control.set("ready", "1")
    try:
        training_started = time.monotonic()
        loop.run()
        training_s = time.monotonic() - training_started
        state = fetch_state(client)
        path = checkpoint.save_state(
            est.model_dir, state, {**manifest, "ps_stats": state.stats}, keep=est.keep_checkpoint_max
        )
        metrics: dict[str, float] = {}
        if loop.eval_spec is not None:
            last = loop.eval_history[-1] if loop.eval_history else None
            metrics = last["metrics"] if last and last["global_step"] == state.step else loop.evaluate(state.step)
        client.shutdown()
        control.set("shutdown", "1")
        if role.spec.num("evaluator") and eval_spec is not None:
            final = control.get("eval/final", waiting_for="the evaluator's last evaluation", timeout_s=600)
            metrics = json.loads(final)["metrics"]
        profiler.collect(loop.capture_roles, timeout_s=30.0, final=True)
        captures = profiler.completed
    finally:
        job_file.unlink(missing_ok=True)
        loop.summaries.close()
        profiler.close()
        client.close()
        est._live_parameters = None
    progress = loop.progress
    first = [p["first_loss"] for p in progress.values() if p.get("first_loss") is not None]
    final_losses = [p["loss"] for p in progress.values() if p.get("local_step")]
    return TrainResult(
        global_step=state.step,
        metrics=metrics,
        checkpoint=str(path),
        first_loss=sum(first) / len(first) if first else None,
        final_loss=sum(final_losses) / len(final_losses) if final_losses else None,
        elapsed_s=time.monotonic() - started,
        training_s=training_s,
        start_step=start_step,
        worker_steps={name: int(p["local_step"]) for name, p in progress.items()},
        ps_stats=state.stats,
        profile_dir=str(captures[-1]) if captures else None,
        eval_history=loop.eval_history,
        stopped_early=loop.stopped_early,
    )


def _write_job_file(est: Estimator, role: RoleContext) -> Path:
    """Where a tool finds the running job (`shardflow profile capture MODEL_DIR`)."""
    est.model_dir.mkdir(parents=True, exist_ok=True)
    path = est.model_dir / "job.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"control": role.control.address, "pid": os.getpid()}))
    os.replace(tmp, path)
    return path
