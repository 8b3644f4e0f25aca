"""The worker loop: pull, forward/backward, push. Stateless: everything it needs comes from the chief and the PS."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from shardflow import env
from shardflow.cluster import control_keys
from shardflow.cluster.spec import TaskSpec
from shardflow.comm.client import Client
from shardflow.comm.security import job_credentials
from shardflow.data.torch_edge import to_torch
from shardflow.profile import spans
from shardflow.profile.recorder import SpanRecorder
from shardflow.ps.client import ParameterClient, Pushed, StepReply
from shardflow.ps.clipping import clip_local_gradients
from shardflow.ps.placement import Placement
from shardflow.train.heartbeat import Heartbeat
from shardflow.train.hooks import StepHooks
from shardflow.train.input import InputPosition
from shardflow.train.job import JobConfig
from shardflow.train.precision import autocast
from shardflow.train.profiling import RoleProfiler
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import InputContext

log = logging.getLogger(__name__)

_REPORT_EVERY_S = 1.0
_SUMMARY_KEEP_S = 30.0


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
    client = ParameterClient(
        Client(role.task.name, credentials=job_credentials()),
        addresses,
        placement,
        model,
        timeout_s=strategy.request_timeout_s,
        worker_index=role.task.index if role.task.type == "worker" else -1,
    )
    if role.task.type == "worker" and _shared_memory():
        client.attach_lanes()
    client.generation = generation = recovery_generation(role)
    client.check_restored = lambda: _check_restored(role, generation)
    return client


def _shared_memory() -> bool:
    setting = env.get(env.SHARED_MEMORY) or "on"
    if setting not in ("on", "off"):
        raise ValueError(f"{env.SHARED_MEMORY}={setting!r}: use on (the default) or off (every byte over the socket)")
    return setting == "on"


class PSRestored(Exception):
    """The chief restored every PS from a checkpoint after one was lost: what this worker was doing belongs to the
    training before, and it starts again from where the PS now say it stands (see train/chief_loop.py)."""


def recovery_generation(role: RoleContext) -> int:
    """How many times the PS of this job were restored after one was lost, so far."""
    if not role.control.is_set(control_keys.RECOVERY):
        return 0
    return int(json.loads(role.control.get(control_keys.RECOVERY, waiting_for="the recovery"))["generation"])


class JobOver(Exception):
    """The chief ended the job (done, failed or preempted) while this worker waited for a PS."""


def _check_restored(role: RoleContext, generation: int) -> None:
    """Between slices of a wait for a PS: has the chief restored the PS, or ended the job?"""
    if recovery_generation(role) > generation:
        raise PSRestored(f"{role.task.name}: the parameter servers were restored; rejoining")
    if role.control.is_set(control_keys.SHUTDOWN):
        raise JobOver(f"{role.task.name}: the chief ended the job while this worker waited for a parameter server")


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
    generation = recovery_generation(role)
    deadline = time.monotonic() + role.control.timeout_s
    # After a recovery, until the chief has restored every PS, some still hold the state before it.
    while rejoined.generation < generation:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{role.task.name} waited {role.control.timeout_s:.0f}s for the PS to be restored")
        time.sleep(0.1)
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


def run_worker_role(
    job: JobConfig, role: RoleContext, on_connect: Callable[[ParameterClient | None], None] = lambda _: None
) -> None:
    """The worker's main. Train; then stay until the chief says the job is over, reading the shards of workers lost
    for good that the chief hands over. Whenever the PS are restored after one was lost, even once this worker has
    finished its input, it starts again from where the PS now say it stands."""
    adopted: list[RoleContext] = []
    finished: set[str] = set()
    """Of this worker and those it adopted, the ones done with the current recovery generation."""
    while True:
        generation = recovery_generation(role)
        try:
            for each in (role, *adopted):
                if each.task.name not in finished:
                    run_worker(job, each, on_connect=on_connect)
                    finished.add(each.task.name)
        except PSRestored as restored:
            log.warning("%s", restored)
            finished.clear()  # every one of them goes on from where the restored PS say it stands
            continue
        except JobOver as over:
            log.warning("%s", over)
            return
        progress = control_keys.progress(role.task.name)
        handover = control_keys.handover(role.task.name)
        try:
            while not role.control.is_set(control_keys.SHUTDOWN):
                if recovery_generation(role) > generation:
                    finished.clear()
                    break
                if role.last_report is not None and not role.control.is_set(progress):
                    role.control.set(progress, role.last_report)  # a restarted chief learns this worker is done
                if role.control.is_set(handover):
                    names = json.loads(role.control.get(handover, waiting_for="the handed-over workers"))
                    new = [name for name in names if name not in {each.task.name for each in adopted}]
                    if new:
                        for name in new:
                            log.warning("%s reads the rest of %s's shard, as %s", role.task.name, name, name)
                            task = TaskSpec("worker", int(name.rpartition(":")[2]))
                            adopted.append(dataclasses.replace(role, task=task, last_report=None))
                        break
                _wait_for_the_end(role)
            else:
                return
        except RuntimeError:  # the chief's control plane closed: the job is over, or the chief's failure says why
            log.info("%s: the chief is gone after this worker finished; exiting", role.task.name)
            return


def _wait_for_the_end(role: RoleContext, timeout_s: float = 0.2) -> None:
    """Until the chief says the job is over, or `timeout_s` passed: the chief's control service holds the request,
    so a worker that is done exits as soon as it is told. Raises ControlPlaneError when the chief did not answer."""
    role.control.set_within(control_keys.SHUTDOWN, timeout_s, waiting_for="the end of the job")


def run_worker(
    job: JobConfig, role: RoleContext, on_connect: Callable[[ParameterClient | None], None] = lambda _: None
) -> None:
    """Train on this worker's shard until the PS say stop or the input ends; `on_connect` is told the client to
    the PS while it exists (Estimator.global_step reads it). A restarted worker goes on where it stopped."""
    control = role.control
    spec = job.train_spec
    heartbeat = Heartbeat(role.task.name, role.control)
    profiler = RoleProfiler(role.task.name, control)
    recorder = profiler.recorder
    control.get(control_keys.READY, waiting_for="the chief to initialise the parameter servers")
    device = job.strategy.worker_device()
    model = job.build_model().to(device)
    parameters = list(model.parameters())
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
    report = Report(role, params.local_step, job.save_summary_steps)
    report.generation = params.generation
    # An update is one worker's gradient in async and ssp mode, so the worker clips it by its global norm itself;
    # in sync mode the PS clip the mean of the replicas' (ps/clipping.py).
    clip_on_worker = job.optimizer.clip_grad_norm if mode != "sync" else None
    changes_gradients = clip_on_worker is not None or job.strategy.gradient_accumulation_steps > 1
    lr_from_worker = job.optimizer.schedule is not None and job.optimizer.schedule.from_workers
    try:
        while not stop:
            step_started = time.perf_counter_ns()
            batch = position.next()
            recorder.end(spans.INPUT_WAIT, step, step_started)
            report.input_wait_ns += time.perf_counter_ns() - step_started
            if batch is None:
                break
            for param in parameters:  # model.zero_grad(set_to_none=True) without walking the modules (~20 us)
                param.grad = None
            if lr_from_worker:  # a function of the step: the PS cannot run it, so the push says
                params.push_lr = job.optimizer.learning_rate(step)
            params.begin_push(step, push_early=not changes_gradients)
            loss = _forward_backward(job, model, params, position, batch, step, report, recorder)
            # A NaN or inf loss is not backpropagated: every PS is told, and refuses the step alike.
            if loss is None:
                in_flight.append(params.push_nonfinite_loss())
            else:
                if clip_on_worker is not None:
                    clip_local_gradients(model, clip_on_worker)
                in_flight.append(params.end_push())
            recorded_step = step
            while len(in_flight) > depth:
                pushed = in_flight.popleft()
                reply = params.wait_push(pushed)
                _check_finite(role.task.name, job.strategy.max_nonfinite_updates, pushed, reply)
                step, stop = reply.step, stop or reply.stop
            recorder.end(spans.STEP, recorded_step, step_started)
            report.step(float("nan") if loss is None else loss, position.epoch, recorded_step)
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


def _forward_backward(
    job: JobConfig,
    model: torch.nn.Module,
    params: ParameterClient,
    position: InputPosition,
    batch: Any,
    step: int,
    report: Report,
    recorder: SpanRecorder,
) -> float | None:
    """Forward and backward of one step's `gradient_accumulation_steps` batches, `batch` first: each loss divided
    by their number, so the summed gradient is that of their mean loss. Returns that mean, or None as soon as a
    loss holds NaN or inf (it is not backpropagated). When the input ends within the step, the gradient is
    rescaled to the mean over the batches read."""
    num_batches = job.strategy.gradient_accumulation_steps
    losses: list[float] = []
    while True:
        params.input_state = position.get_state()
        t = time.perf_counter_ns()
        with autocast(job.strategy.mixed_precision, params.staging.device.type):
            loss = job.loss_fn(model, batch_to_device(to_torch(batch), params.staging.device))
        recorder.end(spans.FORWARD, step, t)
        value = float(loss.detach())  # one read back (a device sync), which the report needs anyway
        if not math.isfinite(value):
            return None
        t = time.perf_counter_ns()
        (loss / num_batches if num_batches > 1 else loss).backward()
        recorder.end(spans.BACKWARD, step, t)
        losses.append(value)
        if len(losses) == num_batches:
            break
        waited = time.perf_counter_ns()
        batch = position.next()
        report.input_wait_ns += time.perf_counter_ns() - waited
        if batch is None:
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(num_batches / len(losses))
            break
    return sum(losses) / len(losses)


def batch_to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with its tensors on `device`, inside dicts, tuples (named ones too) and lists; other values as they
    are. On the CPU the tensors themselves: no copy."""
    if isinstance(batch, torch.Tensor):
        # Overlaps the host only from pinned memory (as_torch(pin_memory=True)); the step's kernels queue after it.
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: batch_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple):
        items = [batch_to_device(value, device) for value in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, list):
        return [batch_to_device(value, device) for value in batch]
    return batch


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

    def __init__(self, role: RoleContext, local_step: int = 0, save_summary_steps: int = 100) -> None:
        self.role = role
        self.save_summary_steps = save_summary_steps
        # Loss sum and count per summary interval of global steps (by the step its batch was computed on): the
        # chief writes each interval's mean once every worker is past it.
        self.summary_losses: dict[int, list[float]] = {}
        self.summary_interval = -1
        """The interval of this worker's latest step; it adds to no earlier one."""
        self._completed: dict[int, float] = {}
        self.started = self.last_sent = time.monotonic()
        self.local_step = local_step
        self._first_local_step = local_step
        self.epoch = 0
        self.first_loss: float | None = None
        self.last_loss = 0.0
        self.input_wait_ns = 0
        self.generation = 0
        """The recovery generation this run of the worker belongs to: the chief counts a "done" of the current one."""

    def step(self, loss: float, epoch: int, base_step: int) -> None:
        """One step of this worker, computed on the parameters of global step `base_step`."""
        self.local_step += 1
        self.last_loss = loss
        self.epoch = epoch
        if self.first_loss is None:
            self.first_loss = loss
        interval = base_step // self.save_summary_steps
        if math.isfinite(loss):
            total = self.summary_losses.setdefault(interval, [0.0, 0])
            total[0] += loss
            total[1] += 1
        # An interval is complete once this worker is past it (its base steps only grow); it is reported for
        # _SUMMARY_KEEP_S more, so the chief sees it even when it was busy (a checkpoint, an evaluation) meanwhile.
        now = time.monotonic()
        for k in [k for k in self.summary_losses if k < interval]:
            if now - self._completed.setdefault(k, now) > _SUMMARY_KEEP_S:
                del self.summary_losses[k], self._completed[k]
        self.summary_interval = interval

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
            "generation": self.generation,
            "summary_losses": {str(k): v for k, v in self.summary_losses.items()},
            "summary_interval": self.summary_interval,
        }
        self.role.last_report = json.dumps(progress)
        self.role.control.set(control_keys.progress(self.role.task.name), self.role.last_report)
