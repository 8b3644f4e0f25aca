"""The worker loop: pull, forward/backward, push. Stateless: everything it needs comes from the chief and the PS."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from shardflow.comm.client import Client
from shardflow.ps.client import ParameterClient
from shardflow.ps.placement import Placement
from shardflow.train.batches import to_torch
from shardflow.train.hooks import StepHooks
from shardflow.train.input import InputPosition
from shardflow.train.profiling import RoleProfiler
from shardflow.train.specs import InputContext, TrainSpec

if TYPE_CHECKING:
    from shardflow.train.estimator import Estimator
    from shardflow.train.roles import RoleContext

_REPORT_EVERY_S = 1.0


def connect_parameters(est: Estimator, role: RoleContext, model: torch.nn.Module) -> ParameterClient:
    """Find the PS through the control plane and build a client that moves this model's variables."""
    control = role.control
    strategy = est.strategy
    placement = Placement.from_json(
        json.loads(control.get("placement", waiting_for="the chief to place the variables"))
    )
    addresses = [control.endpoint(f"ps/{k}", waiting_for=f"ps:{k} to start") for k in range(placement.num_ps)]
    return ParameterClient(
        Client(role.task.name),
        addresses,
        placement,
        model,
        timeout_s=strategy.request_timeout_s,
        worker_index=role.task.index if role.task.type == "worker" else -1,
    )


def _restored_position(role: RoleContext) -> dict[str, Any] | None:
    """This worker's input position from the checkpoint the chief restored, if any."""
    if not role.control.is_set("restore/iterators"):
        return None
    positions = json.loads(role.control.get("restore/iterators", waiting_for="the restored input positions"))
    position: dict[str, Any] | None = positions.get(role.task.name)
    return position


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
    position = InputPosition(spec, InputContext(role.num_workers, role.task.index), _restored_position(role))
    profiler.check_requests()
    hooks = StepHooks(spec.hooks, role.task.name, role.task.index)

    reply = params.pull()
    step, stop = reply.step, reply.stop
    in_flight: deque[dict[str, int]] = deque()
    report = Report(role)
    try:
        while not stop:
            step_started = time.perf_counter_ns()
            batch = position.next()
            recorder.end("input_wait", step, step_started)
            report.input_wait_ns += time.perf_counter_ns() - step_started
            if batch is None:
                break
            batch = to_torch(batch)
            model.zero_grad(set_to_none=True)
            params.input_state = position.get_state()
            params.begin_push({"base_step": step}, step)
            t = time.perf_counter_ns()
            loss = est.loss_fn(model, batch)
            recorder.end("forward", step, t)
            t = time.perf_counter_ns()
            loss.backward()
            recorder.end("backward", step, t)
            in_flight.append(params.end_push())
            recorded_step = step
            while len(in_flight) > depth:
                reply = params.wait_push(in_flight.popleft())
                step, stop = reply.step, stop or reply.stop
            recorder.end("step", recorded_step, step_started)
            report.step(float(loss.detach()), position.epoch)
            stop = hooks.after_step(report.local_step, step, report.last_loss) or stop
            profiler.at_step(step)
            if report.due():
                report.send()
                profiler.check_requests()
        while in_flight:
            params.wait_push(in_flight.popleft(), load_params=False)
        params.done()
    finally:
        params.close()
        profiler.finish()
    hooks.end(report.local_step, step)
    report.send(done=True)
    control.add("workers_done", 1)


class Report:
    """The worker's progress, sent to the chief about once a second (also its heartbeat)."""

    def __init__(self, role: RoleContext) -> None:
        self.role = role
        self.started = self.last_sent = time.monotonic()
        self.local_step = 0
        self.epoch = 0
        self.first_loss: float | None = None
        self.last_loss = 0.0
        self.input_wait_ns = 0

    def step(self, loss: float, epoch: int) -> None:
        self.local_step += 1
        self.last_loss = loss
        self.epoch = epoch
        if self.first_loss is None:
            self.first_loss = loss

    def due(self) -> bool:
        return time.monotonic() - self.last_sent >= _REPORT_EVERY_S

    def send(self, done: bool = False) -> None:
        self.last_sent = time.monotonic()
        elapsed = self.last_sent - self.started
        progress = {
            "local_step": self.local_step,
            "epoch": self.epoch,
            "first_loss": self.first_loss,
            "loss": self.last_loss,
            "steps_per_s": self.local_step / elapsed if elapsed > 0 else 0.0,
            "input_wait_share": self.input_wait_ns / 1e9 / elapsed if elapsed > 0 else 0.0,
            "time": time.time(),
            "done": done,
        }
        self.role.control.set(f"progress/{self.role.task.name}", json.dumps(progress))
