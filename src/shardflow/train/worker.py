"""The worker loop: pull, forward/backward, push. Stateless: everything it needs comes from the chief and the PS."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from shardflow.cluster import control_keys
from shardflow.cluster.rendezvous import ControlPlane
from shardflow.comm.client import Client
from shardflow.data.torch_edge import to_torch
from shardflow.profile import spans
from shardflow.ps.client import ParameterClient, Pushed, StepReply
from shardflow.ps.placement import Placement
from shardflow.train.hooks import StepHooks
from shardflow.train.input import InputPosition
from shardflow.train.job import JobConfig
from shardflow.train.profiling import RoleProfiler
from shardflow.train.roles import RoleContext
from shardflow.train.specs import InputContext

log = logging.getLogger(__name__)

_REPORT_EVERY_S = 1.0


class NonFiniteUpdateError(RuntimeError):
    """The job's `max_nonfinite_updates` was reached: that many steps held NaN or inf; none was applied."""


def connect_parameters(job: JobConfig, role: RoleContext, model: torch.nn.Module) -> ParameterClient:
    """Find the PS through the control plane and build a client that moves this model's variables."""
    control = role.control
    strategy = job.strategy
    placement = Placement.from_json(
        json.loads(control.get(control_keys.PLACEMENT, waiting_for="the chief to place the variables"))
    )
    addresses = [
        control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to start") for k in range(placement.num_ps)
    ]
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
    if not role.control.is_set(control_keys.RESTORE_ITERATORS):
        return None
    positions = json.loads(role.control.get(control_keys.RESTORE_ITERATORS, waiting_for="the restored input positions"))
    position: dict[str, Any] | None = positions.get(role.task.name)
    return position


def _resume(role: RoleContext, params: ParameterClient) -> dict[str, Any] | None:
    """Where this worker's input starts: after the last of its steps every PS has, when it ran before (it was
    restarted); else the restored checkpoint's position, if any. Its step count goes on from there."""
    rejoined = params.rejoin()
    if not rejoined.local_step and not rejoined.ahead:
        return _restored_position(role)
    log.warning(
        "%s rejoins the job after %d steps of its own; it resumes its input after the last step every PS applied%s",
        role.task.name,
        rejoined.local_step,
        f" and repeats the next {rejoined.ahead}, which only some PS had (the others apply them)"
        if rejoined.ahead
        else "",
    )
    return rejoined.input_state if rejoined.local_step else _restored_position(role)


def run_worker(
    job: JobConfig, role: RoleContext, on_connect: Callable[[ParameterClient | None], None] = lambda _: None
) -> None:
    """Train on this worker's shard until the PS say stop or the input ends; `on_connect` is told the client to
    the PS while it exists (Estimator.global_step reads it). A restarted worker goes on where it stopped."""
    control = role.control
    spec = job.train_spec
    heartbeat = Heartbeat(role)
    profiler = RoleProfiler(role.task.name, control)
    recorder = profiler.recorder
    control.get(control_keys.READY, waiting_for="the chief to initialise the parameter servers")
    model = job.build_model()
    params = connect_parameters(job, role, model)
    on_connect(params)
    mode = job.strategy.mode
    # Async only: push step t, then compute step t+1 while the PS applies it (the result is one step staler).
    depth = 1 if mode == "async" and job.strategy.overlap else 0
    position = InputPosition(spec, InputContext(role.num_workers, role.task.index), _resume(role, params))
    profiler.check_requests()
    hooks = StepHooks(spec.hooks, role.task.name, role.task.index)

    reply = params.pull()
    step, stop = reply.step, reply.stop
    in_flight: deque[Pushed] = deque()
    report = Report(role, params.local_step)
    try:
        while not stop:
            step_started = time.perf_counter_ns()
            batch = position.next()
            recorder.end(spans.INPUT_WAIT, step, step_started)
            report.input_wait_ns += time.perf_counter_ns() - step_started
            if batch is None:
                break
            batch = to_torch(batch)
            model.zero_grad(set_to_none=True)
            params.input_state = position.get_state()
            params.begin_push(step)
            t = time.perf_counter_ns()
            loss = job.loss_fn(model, batch)
            recorder.end(spans.FORWARD, step, t)
            # A NaN or inf loss is not backpropagated: every PS is told, and refuses the step alike.
            if bool(torch.isfinite(loss.detach()).all()):
                t = time.perf_counter_ns()
                loss.backward()
                recorder.end(spans.BACKWARD, step, t)
                in_flight.append(params.end_push())
            else:
                in_flight.append(params.push_nonfinite_loss())
            recorded_step = step
            while len(in_flight) > depth:
                pushed = in_flight.popleft()
                reply = params.wait_push(pushed)
                _check_finite(role.task.name, job.strategy.max_nonfinite_updates, pushed, reply)
                step, stop = reply.step, stop or reply.stop
            recorder.end(spans.STEP, recorded_step, step_started)
            report.step(float(loss.detach()), position.epoch)
            stop = hooks.after_step(report.local_step, step, report.last_loss) or stop
            profiler.at_step(step)
            if report.due():
                report.send()
                profiler.check_requests()
        while in_flight:
            pushed = in_flight.popleft()
            reply = params.wait_push(pushed, load_params=False)
            _check_finite(role.task.name, job.strategy.max_nonfinite_updates, pushed, reply)
        params.done()
    finally:
        params.close()
        on_connect(None)
        profiler.finish()
        heartbeat.stop()
    hooks.end(report.local_step, step)
    report.send(done=True)


def _check_finite(name: str, max_nonfinite_updates: int, pushed: Pushed, reply: StepReply) -> None:
    """Raise once the PS have refused `max_nonfinite_updates` non-finite steps in all; this step's refusal was
    the count the PS reply with. The error reaches the chief through this worker's failure key."""
    if not reply.nonfinite:
        return
    found = "computed a NaN or inf loss" if pushed.nonfinite == "loss" else "pushed NaN or inf gradients"
    line = f"{name} {found} at global step {pushed.base_step} ({reply.nonfinite} of at most {max_nonfinite_updates})"
    if reply.nonfinite >= max_nonfinite_updates:
        raise NonFiniteUpdateError(f"{line}; none were applied")
    log.warning("%s; not applied, training goes on", line)


class Report:
    """The worker's progress, sent to the chief about once a second (also its heartbeat)."""

    def __init__(self, role: RoleContext, local_step: int = 0) -> None:
        self.role = role
        self.started = self.last_sent = time.monotonic()
        self.local_step = local_step
        self._first_local_step = local_step
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
            "steps_per_s": (self.local_step - self._first_local_step) / elapsed if elapsed > 0 else 0.0,
            "input_wait_share": self.input_wait_ns / 1e9 / elapsed if elapsed > 0 else 0.0,
            "time": time.time(),
            "done": done,
        }
        self.role.control.set(control_keys.progress(self.role.task.name), json.dumps(progress))


class Heartbeat:
    """Beats every `interval_s` from a thread of its own, over a connection of its own, from the worker's start to
    its end: a step of any length, or a long start-up, is never taken for a lost worker (see chief_loop.py)."""

    def __init__(self, role: RoleContext, interval_s: float = 1.0) -> None:
        self._key = control_keys.heartbeat(role.task.name)
        self._control = ControlPlane(role.control.address, is_chief=False, timeout_s=role.control.timeout_s)
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._beat(0)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, count: int) -> None:
        # The pid too: a restarted worker's beats differ from its earlier run's even where the counts meet.
        self._control.set(self._key, f"{os.getpid()}:{count}")

    def _run(self) -> None:
        count = 1
        while not self._stopped.wait(self._interval_s):
            try:
                self._beat(count)
            except (RuntimeError, OSError):  # the chief is gone; the worker's own requests will say so
                return
            count += 1

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2 * self._interval_s)
