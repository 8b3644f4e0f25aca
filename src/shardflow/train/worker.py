"""The worker loop: pull, forward/backward, push. Stateless: everything it needs comes from the chief and the PS."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from shardflow.comm.client import Client
from shardflow.ps.client import ParameterClient
from shardflow.ps.placement import Placement
from shardflow.train.batches import to_torch
from shardflow.train.profiling import RoleProfiler
from shardflow.train.specs import InputContext, TrainSpec

if TYPE_CHECKING:
    from shardflow.train.estimator import Estimator
    from shardflow.train.roles import RoleContext

_REPORT_EVERY_S = 1.0


def _epochs(spec: TrainSpec, ctx: InputContext) -> Iterator[Any]:
    epoch = 0
    while spec.epochs is None or epoch < spec.epochs:
        yield from spec.input_fn(ctx)
        epoch += 1


def connect_parameters(est: Estimator, role: RoleContext, model: torch.nn.Module) -> ParameterClient:
    """Find the PS through the control plane and build a client that moves this model's variables."""
    control = role.control
    strategy = est.strategy
    placement = Placement.from_json(
        json.loads(control.get("placement", waiting_for="the chief to place the variables"))
    )
    addresses = [control.get(f"ps/{k}/address", waiting_for=f"ps:{k} to start") for k in range(placement.num_ps)]
    return ParameterClient(
        Client(role.task.name),
        addresses,
        placement,
        model,
        timeout_s=strategy.request_timeout_s,
        worker_index=role.task.index if role.task.type == "worker" else -1,
    )


def run_worker(est: Estimator, spec: TrainSpec, role: RoleContext) -> None:
    control = role.control
    profiler = RoleProfiler(role.task.name, control)
    recorder = profiler.recorder
    control.get("ready", waiting_for="the chief to initialise the parameter servers")
    model = est.build_model()
    params = connect_parameters(est, role, model)
    est._live_parameters = params
    mode = est.strategy.mode
    # Async only: push step t, then compute step t+1 while the PS applies it (the result is one step staler).
    depth = 1 if mode == "async" and est.strategy.overlap else 0
    ctx = InputContext(role.num_workers, role.task.index)
    profiler.check_requests()

    reply = params.pull()
    step, stop = reply.step, reply.stop
    in_flight: deque[dict[str, int]] = deque()
    local_step = 0
    first_loss: float | None = None
    last_loss = 0.0
    started = last_report = time.monotonic()
    try:
        batches = _epochs(spec, ctx)
        while not stop:
            step_started = time.perf_counter_ns()
            batch = next(batches, None)
            recorder.end("input_wait", step, step_started)
            if batch is None:
                break
            batch = to_torch(batch)
            model.zero_grad(set_to_none=True)
            params.begin_push({"base_step": step}, step)
            t = time.perf_counter_ns()
            loss = est.loss_fn(model, batch)
            recorder.end("forward", step, t)
            t = time.perf_counter_ns()
            loss.backward()
            recorder.end("backward", step, t)
            in_flight.append(params.end_push())
            local_step += 1
            last_loss = float(loss.detach())
            if first_loss is None:
                first_loss = last_loss
            recorded_step = step
            while len(in_flight) > depth:
                reply = params.wait_push(in_flight.popleft())
                step, stop = reply.step, stop or reply.stop
            recorder.end("step", recorded_step, step_started)
            profiler.at_step(step)
            now = time.monotonic()
            if now - last_report >= _REPORT_EVERY_S:
                last_report = now
                _report(role, local_step, first_loss, last_loss, started)
                profiler.check_requests()
        while in_flight:
            params.wait_push(in_flight.popleft(), load_params=False)
        params.done()
    finally:
        params.close()
        profiler.finish()
    _report(role, local_step, first_loss, last_loss, started, done=True)
    control.add("workers_done", 1)


def _report(
    role: RoleContext,
    local_step: int,
    first_loss: float | None,
    loss: float,
    started: float,
    done: bool = False,
) -> None:
    elapsed = time.monotonic() - started
    progress = {
        "local_step": local_step,
        "first_loss": first_loss,
        "loss": loss,
        "steps_per_s": local_step / elapsed if elapsed > 0 else 0.0,
        "time": time.time(),
        "done": done,
    }
    role.control.set(f"progress/{role.task.name}", json.dumps(progress))
