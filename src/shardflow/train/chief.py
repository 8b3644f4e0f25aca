"""The chief: places variables, initialises the PS, watches the workers, and writes the checkpoint."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardflow.cluster.rendezvous import ControlPlane
from shardflow.comm.client import Client
from shardflow.ps.apply import ApplyConfig
from shardflow.ps.client import ParameterClient
from shardflow.ps.placement import place
from shardflow.train import checkpoint
from shardflow.train.profiling import REQUEST, ChiefProfiler
from shardflow.train.specs import EvalSpec, TrainResult, TrainSpec

if TYPE_CHECKING:
    from shardflow.train.estimator import Estimator
    from shardflow.train.roles import RoleContext

log = logging.getLogger(__name__)


def _pick_up_capture(profiler: ChiefProfiler, control: ControlPlane) -> None:
    """A tool asked for a capture of the running job through the control plane."""
    if control.is_set(REQUEST):
        request = json.loads(control.get(REQUEST, waiting_for="the capture request"))
        if not any(p["name"] == request["name"] for p in profiler.pending) and not control.is_set(
            f"capture/{request['name']}/done"
        ):
            profiler.request(request["first"], request["last"], ops=request.get("ops", False), name=request["name"])


class WorkerFailedError(RuntimeError):
    """A worker reported a failure, or stopped reporting, while the job ran."""


def _restore(est: Estimator, model: torch.nn.Module) -> int:
    path = checkpoint.latest(est.model_dir)
    if path is None:
        return 0
    tensors, manifest = checkpoint.load(path)
    model.load_state_dict(tensors)
    log.info("restored %s at global step %d", path, manifest["global_step"])
    return int(manifest["global_step"])


def run_chief(est: Estimator, spec: TrainSpec, eval_spec: EvalSpec | None, role: RoleContext) -> TrainResult:
    control = role.control
    strategy = est.strategy
    started = time.monotonic()
    model = est.build_model()
    start_step = _restore(est, model)
    placement = place(model.named_parameters(), role.num_ps, strategy.partitioner)
    addresses = [control.get(f"ps/{k}/address", waiting_for=f"ps:{k} to start") for k in range(role.num_ps)]
    params = ParameterClient(Client("chief"), addresses, placement, model, timeout_s=strategy.request_timeout_s)
    est._live_parameters = params
    apply = ApplyConfig(
        mode=strategy.mode,
        num_workers=role.num_workers,
        replicas_to_aggregate=strategy.replicas_to_aggregate,
        max_staleness=strategy.max_staleness,
        max_steps=spec.max_steps,
    )
    params.init_servers(est.optimizer, apply, step=start_step)
    profiler = ChiefProfiler(control, role.spec.address(role.task).rpartition(":")[0], est.model_dir)
    roles = [t.name for t in role.spec.tasks() if t.type in ("chief", "ps", "worker")]
    if est.profile_steps is not None:
        profiler.request(*est.profile_steps, ops=est.profile_ops)
    control.set("placement", json.dumps(placement.to_json()))
    job_file = _write_job_file(est, role)
    control.set("ready", "1")
    try:
        training_started = time.monotonic()
        progress = _wait_for_workers(role, strategy.heartbeat_timeout_s, profiler, roles)
        training_s = time.monotonic() - training_started
        tensors, ps_stats = params.fetch_state()
        global_step = int(ps_stats["ps:0"]["step"])
        with profiler.recorder.span("checkpoint", global_step):
            manifest = {"placement": placement.to_json(), "ps_stats": ps_stats, "mode": strategy.mode}
            path = checkpoint.save(est.model_dir, global_step, tensors, manifest)
        with profiler.recorder.span("eval", global_step):
            metrics = est.evaluate_model(model, eval_spec) if eval_spec is not None else {}
        params.shutdown()
        control.set("shutdown", "1")
        captures = profiler.collect(roles, timeout_s=30.0, final=True)
    finally:
        job_file.unlink(missing_ok=True)
        profiler.close()
        params.close()
        est._live_parameters = None
    first = [p["first_loss"] for p in progress.values() if p.get("first_loss") is not None]
    final = [p["loss"] for p in progress.values() if p.get("local_step")]
    return TrainResult(
        global_step=global_step,
        metrics=metrics,
        checkpoint=str(path),
        first_loss=sum(first) / len(first) if first else None,
        final_loss=sum(final) / len(final) if final else None,
        elapsed_s=time.monotonic() - started,
        training_s=training_s,
        start_step=start_step,
        worker_steps={name: int(p["local_step"]) for name, p in progress.items()},
        profile_dir=str(captures[-1]) if captures else None,
        ps_stats=ps_stats,
    )


def _write_job_file(est: Estimator, role: RoleContext) -> Path:
    """Where a tool finds the running job (`shardflow profile capture MODEL_DIR`)."""
    est.model_dir.mkdir(parents=True, exist_ok=True)
    path = est.model_dir / "job.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"control": role.control.address, "pid": os.getpid()}))
    os.replace(tmp, path)
    return path


def _wait_for_workers(
    role: RoleContext, heartbeat_timeout_s: float, profiler: ChiefProfiler, roles: list[str]
) -> dict[str, dict[str, Any]]:
    """Wait until every worker is done; fail if one reports a failure or goes silent for too long.
    Meanwhile, finish captures requested while the job runs."""
    control = role.control
    names = [f"worker:{i}" for i in range(role.num_workers)]
    last_seen = dict.fromkeys(names, time.monotonic())
    progress: dict[str, dict[str, Any]] = {}
    next_capture_check = time.monotonic()
    while True:
        if time.monotonic() >= next_capture_check:
            next_capture_check = time.monotonic() + 1.0
            _pick_up_capture(profiler, control)
            profiler.collect(roles, timeout_s=10.0)
        for name in names:
            if control.is_set(f"failed/{name}"):
                reason = control.get(f"failed/{name}", waiting_for=name)
                raise WorkerFailedError(f"{name} failed: {reason}")
            if control.is_set(f"progress/{name}"):
                report = json.loads(control.get(f"progress/{name}", waiting_for=name))
                if report != progress.get(name):
                    last_seen[name] = time.monotonic()
                progress[name] = report
            if progress.get(name, {}).get("done"):
                continue
            if time.monotonic() - last_seen[name] > heartbeat_timeout_s:
                raise WorkerFailedError(f"{name} has not reported for {heartbeat_timeout_s:.0f}s")
        if control.add("workers_done", 0) >= len(names):
            return progress
        time.sleep(0.05)
