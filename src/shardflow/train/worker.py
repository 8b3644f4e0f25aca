"""The worker's role: pull, forward/backward, push, until the job is over. Stateless: everything it needs comes from
the chief and the PS."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import torch

from shardflow import env
from shardflow.cluster import control_keys
from shardflow.cluster.spec import TaskSpec
from shardflow.comm.client import Client
from shardflow.comm.security import job_credentials
from shardflow.data.torch_edge import to_torch
from shardflow.nn import backend
from shardflow.profile import spans
from shardflow.ps.client import ParameterClient, Pushed
from shardflow.train import job_keys
from shardflow.train.heartbeat import Heartbeat
from shardflow.train.hooks import StepHooks
from shardflow.train.input import InputPosition, Lookahead
from shardflow.train.job import JobConfig
from shardflow.train.profiling import RoleProfiler
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import InputContext
from shardflow.train.thread_tuning import ThreadTuner
from shardflow.train.worker_report import Report
from shardflow.train.worker_step import WorkerStep, batch_to_device

log = logging.getLogger(__name__)


def connect_parameters(
    job: JobConfig[Any],
    role: RoleContext,
    model: torch.nn.Module,
    interrupt: Callable[[], None],
    *,
    lanes: bool = True,
) -> ParameterClient:
    """Find the PS through the control plane and build a client that moves this model's variables (under
    HybridStrategy its sf.nn tables only); `interrupt` runs between slices of its waits and raises to end one. A
    worker on the machine of a PS moves its pushes through shared memory where `lanes` (and the setting) allow."""
    control = role.control
    placement = control.read(job_keys.PLACEMENT, waiting_for="the chief to place the variables")
    addresses = [
        control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to start") for k in range(placement.num_ps)
    ]
    client = ParameterClient(
        Client(role.task.name, credentials=job_credentials()),
        addresses,
        placement,
        model,
        timeout_s=job.strategy.request_timeout_s,
        worker_index=role.task.index if role.task.type == "worker" else -1,
        interrupt=interrupt,
        wire_dtype=getattr(job.strategy, "wire_dtype", None),
    )
    if lanes and role.task.type == "worker" and _shared_memory():
        try:
            client.attach_lanes()  # a PS restarted meanwhile: it waits for the restore, then raises PSRestored
        except BaseException:
            client.close()
            raise
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
    notice = role.control.read_if_set(job_keys.RECOVERY)
    return notice.generation if notice is not None else 0


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
    restored = role.control.read_if_set(job_keys.RESTORE_ITERATORS)
    return restored.positions.get(role.task.name) if restored is not None else None


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
    if not rejoined.ahead and not role.control.is_set(job_keys.progress(role.task.name)):
        # No run of this worker reported in this job (each reports as it starts): the steps are the restored
        # checkpoint's, and this is no rejoin.
        log.info(
            "%s resumes its input from the restored checkpoint, after %d steps", role.task.name, rejoined.local_step
        )
        return rejoined.input_state
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
        outcome = _stay_until_the_end(role, generation, adopted)
        if outcome == "over":
            return
        if outcome == "restored":
            finished.clear()
        else:
            adopted += outcome


def _stay_until_the_end(
    role: RoleContext, generation: int, adopted: list[RoleContext]
) -> Literal["over", "restored"] | list[RoleContext]:
    """Once this worker and those it `adopted` are done: wait until the job is over, telling a restarted chief that
    this worker is done. Returns "over"; "restored" when the PS were restored past `generation` meanwhile; or the
    workers lost for good whose shards the chief handed over to this one since."""
    progress = job_keys.progress(role.task.name)
    handover = job_keys.handover(role.task.name)
    try:
        while not role.control.is_set(control_keys.SHUTDOWN):
            if recovery_generation(role) > generation:
                return "restored"
            if role.last_report is not None and not role.control.is_set(progress):
                role.control.put(progress, role.last_report)  # a restarted chief learns this worker is done
            if role.control.is_set(handover):
                names = role.control.read(handover, waiting_for="the handed-over workers").workers
                new = [name for name in names if name not in {each.task.name for each in adopted}]
                if new:
                    for name in new:
                        log.warning("%s reads the rest of %s's shard, as %s", role.task.name, name, name)
                    tasks = [TaskSpec("worker", int(name.rpartition(":")[2])) for name in new]
                    return [dataclasses.replace(role, task=task, last_report=None) for task in tasks]
            _wait_for_the_end(role)
    except RuntimeError:  # the chief's control plane closed: the job is over, or the chief's failure says why
        log.info("%s: the chief is gone after this worker finished; exiting", role.task.name)
    return "over"


def _wait_for_the_end(role: RoleContext, timeout_s: float = 0.2) -> None:
    """Until the chief says the job is over, or `timeout_s` passed: the chief's control service holds the request,
    so a worker that is done exits as soon as it is told. Raises ControlPlaneError when the chief did not answer."""
    role.control.set_within(control_keys.SHUTDOWN, timeout_s, waiting_for="the end of the job")


def run_worker(
    job: JobConfig, role: RoleContext, on_connect: Callable[[ParameterClient | None], None] = lambda _: None
) -> None:
    """Train on this worker's shard until the PS say stop or the input ends; `on_connect` is told the client to
    the PS while it exists (Estimator.global_step reads it). A restarted worker goes on where it stopped."""
    name = role.task.name
    heartbeat = Heartbeat(name, role.control, job.strategy.heartbeat_timeout_s)
    profiler = RoleProfiler(name, role.control)
    role.control.get(control_keys.READY, waiting_for="the chief to initialise the parameter servers")
    model = job.build_model().to(job.strategy.worker_device())
    generation = recovery_generation(role)
    try:
        # A PS restarted from here on (even before this worker rejoined) ends in PSRestored once it is restored.
        params = connect_parameters(job, role, model, lambda: _check_restored(role, generation))
    except BaseException:
        profiler.finish()
        heartbeat.stop()
        raise
    hooks = StepHooks(job.train_spec.hooks, name, role.task.index)
    try:
        on_connect(params)
        position = InputPosition(job.train_spec, InputContext(role.num_workers, role.task.index), _resume(role, params))
        profiler.check_requests()
        report = Report(role, params.local_step, job.save_summary_steps, generation)
        report.send()  # at once: a restart of this worker in this job knows from it that it rejoins
        worker = WorkerStep(name, job, model, params, _ahead(position, params), report, profiler.recorder)
        with contextlib.ExitStack() as stack:
            if params.tables is not None:  # the model's sf.nn tables look their rows up on the PS
                stack.enter_context(backend.installed(params.tables))
            step = _train(worker, hooks, profiler)
        if params.tables is not None and params.tables.not_prefetched:
            log.info(
                "%s: %d sf.nn table lookups were made when forward asked, not sent ahead with the step before",
                name,
                params.tables.not_prefetched,
            )
        params.done()
    finally:
        params.close()
        on_connect(None)
        profiler.finish()
        heartbeat.stop()
    hooks.end(report.local_step, step)
    report.send(done=True)


def _ahead(position: InputPosition, params: ParameterClient) -> InputPosition | Lookahead:
    """With `sf.nn` tables, the input is read one batch ahead, whose rows are fetched while a step computes."""
    if params.tables is None:
        return position
    device = params.staging.device
    return Lookahead(position, lambda batch: batch_to_device(to_torch(batch), device))


def _train(worker: WorkerStep, hooks: StepHooks, profiler: RoleProfiler) -> int:
    """Step until the PS say stop or the input ends; returns the global step as the last reply said."""
    position, report, recorder = worker.position, worker.report, worker.recorder
    reply = worker.params.pull()
    step, stop = reply.step, reply.stop
    # Async only: push step t, then compute step t+1 while the PS applies it (the result is one step staler).
    depth = 1 if worker.job.strategy.mode == "async" and worker.job.strategy.overlap else 0
    in_flight: deque[Pushed] = deque()
    tuner = ThreadTuner.for_worker(worker.name, worker.params.staging.device)
    while not stop:
        step_started = time.perf_counter_ns()
        batch = position.next()
        recorder.end(spans.INPUT_WAIT, step, step_started)
        report.input_waited(time.perf_counter_ns() - step_started)
        if batch is None:
            break
        loss, pushed = worker.run(batch, step)
        in_flight.append(pushed)
        recorded_step = step
        while len(in_flight) > depth:
            reply = worker.wait(in_flight.popleft())
            step, stop = reply.step, stop or reply.stop
        recorder.end(spans.STEP, recorded_step, step_started)
        if tuner is not None:
            tuner.step_done((time.perf_counter_ns() - step_started) / 1e9)
        report.step(float("nan") if loss is None else loss, position.epoch, recorded_step)
        stop = hooks.after_step(report.local_step, step, report.last_loss) or stop
        profiler.at_step(step)
        if report.due():
            report.send()
            profiler.check_requests()
    while in_flight:
        worker.wait(in_flight.popleft(), load_params=False)
    return step
