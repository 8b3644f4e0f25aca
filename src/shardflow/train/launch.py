"""A process's start-up: which role it is (from the environment, or the chief of an embedded local cluster that it
starts), its connection to the chief, its logs and result file, and the dispatch to the role's main."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

from shardflow import env
from shardflow.cluster import control_keys, liveness
from shardflow.cluster.control_plane import ControlPlane, ControlPlaneError
from shardflow.cluster.launcher import USER_ERROR_EXIT_CODE, LocalLauncher, RoleExit
from shardflow.cluster.local_job import local_threads
from shardflow.cluster.spec import ClusterSpec, TaskSpec, cluster_from_env, release_local_ports
from shardflow.cluster.zygote import exit_without_final_collection, installed_modules
from shardflow.comm.errors import CommError
from shardflow.comm.security import new_secret
from shardflow.ps.connection import PSConnection
from shardflow.train import job_keys
from shardflow.train.allreduce_chief import run_allreduce_chief
from shardflow.train.allreduce_worker import run_allreduce_worker
from shardflow.train.checkpoints import store
from shardflow.train.chief import run_chief
from shardflow.train.evaluator import run_evaluator
from shardflow.train.hybrid_chief import run_hybrid_chief
from shardflow.train.hybrid_worker import run_hybrid_worker
from shardflow.train.job import (
    JobConfig,
    RoleFailedError,
    UserCodeError,
    is_all_reduce,
    is_hybrid,
    is_parameter_server,
)
from shardflow.train.preemption import Preemption, tell_chief
from shardflow.train.progress import chief_prefix
from shardflow.train.ps_role import run_ps
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import Preempted, TrainResult
from shardflow.train.strategy import Strategy
from shardflow.train.worker import run_worker_role

log = logging.getLogger(__name__)
GONE_AFTER_S = 3.0
"""At the end of the job: a role whose heartbeat (one a second) stood still this long is not waited for."""

OnConnect = Callable[[PSConnection | None], None]
"""Told the role's client to the PS while it exists, then None."""


def run_process(job: JobConfig[Strategy], on_connect: OnConnect) -> TrainResult:
    """Run this process's role of `job`. Returns the result in the chief; other roles exit the process when the job
    is done. `on_connect` is told the role's client to the PS while it exists (Estimator.global_step reads it)."""
    # For this process's supervisor, from its start: the chief's too (a launcher or cluster manager restarts it).
    liveness.keep_touching()
    found = cluster_from_env(num_ps=job.strategy.num_ps, num_workers=job.strategy.num_workers)
    if found is None or found[1].type == "chief":
        check_writable(job.model_dir)  # before any role starts
    finished = _already_finished(job)
    if finished is not None:
        if found is None or found[1].type == "chief":
            return finished
        sys.stdout.flush()
        raise SystemExit(0)
    # A role's process imported torch and what the job needs: without this its exit takes seconds.
    exit_without_final_collection()
    if found is None:
        return _run_embedded(job, on_connect)
    spec, task = found
    if task.type == "chief":
        _say_cluster_size(job, spec)
        return _run_chief(job, spec, task, on_connect)
    _run_other_role(job, spec, task, on_connect)


def check_writable(model_dir: Path) -> None:
    """Raise ValueError naming `model_dir` and why, if this process cannot write checkpoints into it."""
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
        probe = model_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"model_dir {model_dir} cannot be written ({error.strerror or error}): checkpoints, logs and summaries go "
            "there; give Estimator(model_dir=...) a directory you can write"
        ) from None


def _already_finished(job: JobConfig[Strategy]) -> TrainResult | None:
    """What the latest checkpoint holds when it is already at max_steps: a re-run then trains nothing and starts
    no cluster."""
    max_steps = job.train_spec.max_steps
    path = store.latest(job.model_dir) if max_steps is not None else None
    if max_steps is None or path is None:
        return None
    manifest = store.read_manifest(path)
    step = int(manifest["global_step"])
    if step < max_steps:
        return None
    log.warning(
        "restored %s at global step %d: training is already done (max_steps=%d reached); nothing to train. Raise "
        "max_steps to train further",
        path.name,
        step,
        max_steps,
    )
    metrics: dict[str, float] = {}
    history = job.model_dir / "eval" / "history.jsonl"
    if job.eval_spec is not None and history.exists():
        lines = history.read_text().splitlines()
        last = json.loads(lines[-1]) if lines else {}
        if last.get("global_step") == step:
            metrics = last["metrics"]
    return TrainResult(
        global_step=step,
        metrics=metrics,
        checkpoint=str(path),
        first_loss=None,
        final_loss=None,
        elapsed_s=0.0,
        training_s=0.0,
        start_step=step,
        worker_steps={},
        ps_stats=manifest.get("ps_stats", {}),
    )


def _say_cluster_size(job: JobConfig[Strategy], spec: ClusterSpec) -> None:
    """The cluster the environment describes is the one whose processes were started: where the strategy asks for
    other numbers, one line says which won and why."""
    strategy = job.strategy
    num_workers, num_ps = spec.num("worker"), spec.num("ps")
    if (num_workers, num_ps) == (strategy.num_workers, strategy.num_ps):
        return
    if env.get(env.CLUSTER):
        source, fix = "shardflow launch", f"`shardflow launch --workers {strategy.num_workers} --ps {strategy.num_ps}`"
    elif os.environ.get("TF_CONFIG", "").strip():
        source, fix = "TF_CONFIG", "a TF_CONFIG with those"
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return  # cluster_from_env said it already, in torchrun's terms
    else:
        source, fix = "the cluster manager", "a cluster of that size"
    log.warning(
        "training uses the %d worker(s) and %d PS that %s started; the strategy's num_workers=%d, num_ps=%d apply "
        "only where the script starts its own local cluster (python script.py): start it with %s to use them",
        num_workers,
        num_ps,
        source,
        strategy.num_workers,
        strategy.num_ps,
        fix,
    )


def _connect(job: JobConfig[Strategy], spec: ClusterSpec, task: TaskSpec) -> RoleContext:
    if spec.num("ps") < 1 and (not is_all_reduce(job) or is_hybrid(job)):
        raise ValueError(
            f"the cluster has no 'ps' tasks; {type(job.strategy).__name__} needs at least one parameter server"
        )
    if spec.num("worker") < 1:
        raise ValueError("the cluster has no 'worker' tasks; training needs at least one")
    chief = spec.address(TaskSpec("chief", 0))
    connect = ControlPlane.serve if task.type == "chief" else ControlPlane
    control = connect(chief, timeout_s=job.strategy.startup_timeout_s)
    return RoleContext(spec, task, control)


def _run_chief(
    job: JobConfig[Strategy],
    spec: ClusterSpec,
    task: TaskSpec,
    on_connect: OnConnect,
    failures: Sequence[RoleExit] = (),
    preemption: Preemption | None = None,
    control: ControlPlane | None = None,
) -> TrainResult:
    """Raises Preempted, after the final checkpoint, when SIGTERM (or a role's preemption) ended training early.
    `control`: the chief's control plane, served by the caller past the return, while the roles read that the job
    is over; by default this connects, and serves it until every role said goodbye."""
    own_preemption = preemption is None
    if preemption is None:
        preemption = Preemption(job.strategy.termination_grace_s).install(ctrl_c=lambda: not failures)
    role = _connect(job, spec, task) if control is None else RoleContext(spec, task, control)
    log_handlers = _log_to(job.model_dir / "logs" / "chief.log")
    try:
        if is_parameter_server(job):
            result = run_chief(job, role, failures=failures, on_connect=on_connect, preemption=preemption)
        elif is_hybrid(job):
            result = run_hybrid_chief(job, role, failures=failures, preemption=preemption)
        else:
            assert is_all_reduce(job)
            result = run_allreduce_chief(job, role, failures=failures, preemption=preemption)
        _write_result(job, role, result)
        if result.preempted:
            raise Preempted(result)
        return result
    except KeyboardInterrupt:
        if not failures:
            raise
        failed = failures[0]
        key = control_keys.failed(failed.task.name)
        try:
            reason = role.control.get(key, waiting_for=failed.task.name) if role.control.is_set(key) else ""
        except ControlPlaneError:  # the interrupt may have cut a request on this connection short: name it alone
            reason = ""
        raise RoleFailedError(f"{failed.describe()}{': ' + reason if reason else ''}; the job was stopped") from None
    except CommError as error:
        # A PS that stopped answering the chief: the same error as any other failed role, naming it.
        raise RoleFailedError(str(error)) from error
    finally:
        # Tell every role the job is over so none waits for a chief that is gone.
        role.control.set(control_keys.SHUTDOWN, "1")
        if control is None:  # this process ends soon: serve the control plane until the roles have read it
            _await_goodbyes(role)
            role.control.close()
        for handler in log_handlers:
            logging.getLogger("shardflow").removeHandler(handler)
            handler.close()
        if own_preemption:
            preemption.uninstall()


def _await_goodbyes(role: RoleContext, timeout_s: float = 10.0) -> None:
    """Wait (briefly) until every other role has said it saw the end of the job, or is gone: its heartbeat has not
    moved for GONE_AFTER_S since this wait began (killed, stopped, or lost for good), so that a job with a role
    lost does not end that much later. A role that does not beat (the evaluator) is waited for up to `timeout_s`."""
    waiting = {task.name for task in role.spec.tasks() if task != role.task}
    beats: dict[str, tuple[str, float]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while waiting and time.monotonic() < deadline:
            for name in sorted(waiting):
                if role.control.is_set(control_keys.goodbye(name)) or _gone(role.control, name, beats):
                    waiting.discard(name)
            if waiting:
                time.sleep(0.1)
    except ControlPlaneError:
        pass
    if waiting:
        log.info(
            "the chief ends without goodbyes from %s (gone already, or still finishing)", ", ".join(sorted(waiting))
        )


def _gone(control: ControlPlane, name: str, beats: dict[str, tuple[str, float]]) -> bool:
    """Whether role `name`'s heartbeat stood still for GONE_AFTER_S of this wait; `beats` holds each one's last."""
    key = control_keys.heartbeat(name)
    if not control.is_set(key):
        return False
    beat, now = control.get(key, waiting_for=f"{name}'s heartbeat"), time.monotonic()
    last = beats.get(name)
    if last is None or last[0] != beat:
        beats[name] = (beat, now)
        return False
    return now - last[1] >= GONE_AFTER_S


def _run_other_role(job: JobConfig[Strategy], spec: ClusterSpec, task: TaskSpec, on_connect: OnConnect) -> NoReturn:
    threads = env.get_int(env.LOCAL_THREADS)
    if threads:
        torch.set_num_threads(threads)
    role = _connect(job, spec, task)
    # On SIGTERM the role asks the chief to end the job at the current step and carries on until it is over:
    # the process then exits 0 as at any end, or 143 at the deadline if the job never ends.
    Preemption(job.strategy.termination_grace_s).install(tell_chief(role))
    try:
        if task.type == "worker" and is_hybrid(job):
            run_hybrid_worker(job, role)
        elif task.type == "worker" and is_all_reduce(job) and not is_hybrid(job):
            run_allreduce_worker(job, role)
        elif task.type == "ps":
            run_ps(role, job.strategy.heartbeat_timeout_s)
        elif task.type == "worker" and is_parameter_server(job):
            run_worker_role(job, role, on_connect)
        elif task.type == "evaluator":
            run_evaluator(job, role)
    except Exception as error:
        if task.type != "worker" or isinstance(error, ControlPlaneError):  # the chief cannot hear the latter
            raise
        if not _stands_down(role, error):
            with contextlib.suppress(ControlPlaneError):
                role.control.set(control_keys.failed(task.name), f"{type(error).__name__}: {error}")
            if isinstance(error, UserCodeError):  # the same again on a restart: said once, and not restarted
                if error.__cause__ is not None:  # where in the user's code (the chief says what failed)
                    traceback.print_exception(error.__cause__)
                sys.stdout.flush()
                raise SystemExit(USER_ERROR_EXIT_CODE) from None
            raise
    with contextlib.suppress(ControlPlaneError):
        role.control.set(control_keys.goodbye(task.name), "1")
    role.control.close()
    sys.stdout.flush()
    raise SystemExit(0)


def _stands_down(role: RoleContext, error: Exception) -> bool:
    """Whether this worker's shard went to another worker while it was silent (hung, then woken: the chief took it
    for lost for good, see train/chief_loop.py): then what it sends is refused or repeated, and the error that ended
    it is no failure of the job. The adopter reads the rest of the shard as this worker, so every record is still
    applied once."""
    for task in role.spec.tasks():
        if task.type != "worker" or task == role.task:
            continue
        with contextlib.suppress(ControlPlaneError):
            handover = role.control.read_if_set(job_keys.handover(task.name))
            if handover is not None and role.task.name in handover.workers:
                log.warning(
                    "%s: %s reads the rest of this worker's shard since it was lost; it stands down (%s: %s)",
                    role.task.name,
                    task.name,
                    type(error).__name__,
                    error,
                )
                return True
    return False


def _log_to(path: Path) -> list[logging.Handler]:
    """The chief's log records also go to model_dir/logs/chief.log, beside the other roles' logs; its warnings
    (a worker lost, restarted, preempted) also to stderr, as every other role's do, unless the program set up
    logging itself."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _LogFile(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("shardflow")
    handlers: list[logging.Handler] = [handler]
    if not logger.handlers and not logging.getLogger().handlers:
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(f"{chief_prefix()}%(message)s"))
        handlers.append(console)
    for each in handlers:
        logger.addHandler(each)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handlers


class _LogFile(logging.FileHandler):
    """chief.log. A record it cannot write (a full or read-only disk) is said once on stderr, not with a traceback
    for each, and never ends the job."""

    _failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self._failed:
            self._failed = True
            error = sys.exc_info()[1]
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"{chief_prefix()}cannot write {self.baseFilename}: {error}; the job goes on\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            super().close()


def _write_result(job: JobConfig[Strategy], role: RoleContext, result: TrainResult) -> None:
    """SHARDFLOW_RESULT_JSON: where tools such as `shardflow scale` read what the run did."""
    path = env.get(env.RESULT_JSON)
    if not path:
        return
    fields = (
        "global_step",
        "training_s",
        "elapsed_s",
        "worker_steps",
        "metrics",
        "eval_history",
        "profile_dir",
        "preempted",
    )
    payload = {name: getattr(result, name) for name in fields}
    payload.update(num_workers=role.num_workers, num_ps=role.num_ps, mode=job.strategy.mode)
    payload.update(first_loss=result.first_loss, final_loss=result.final_loss, checkpoint=result.checkpoint)
    Path(path).write_text(json.dumps(payload, indent=1))


def _embedded_command() -> list[str]:
    argv = list(sys.orig_argv[1:])
    if not argv or argv[0] == "-c" or argv[0] == "-":
        raise RuntimeError(
            "the embedded local cluster re-runs this program once per role, so it must be a script or module "
            "(python train.py, python -m pkg.train); or start the roles with `shardflow launch`"
        )
    return [sys.executable, *argv]


def _run_embedded(job: JobConfig[Strategy], on_connect: OnConnect) -> TrainResult:
    """No cluster in the environment: this process becomes the chief and starts the other roles itself, on ports it
    holds for them until the job ends."""
    strategy = job.strategy
    spec = ClusterSpec.local(num_workers=strategy.num_workers, num_ps=strategy.num_ps, evaluator=strategy.evaluator)
    try:
        return _run_local_cluster(job, spec, on_connect)
    finally:
        release_local_ports(spec)


def _run_local_cluster(job: JobConfig[Strategy], spec: ClusterSpec, on_connect: OnConnect) -> TrainResult:
    strategy = job.strategy
    chief = TaskSpec("chief", 0)
    if not any(env.get(name) for name in (env.CLUSTER_SECRET, env.CLUSTER_SECRET_FILE, env.INSECURE)):
        # This process is the chief: it and the roles it starts share one fresh secret (the launcher's rule).
        os.environ[env.CLUSTER_SECRET] = new_secret()
    launcher = LocalLauncher(
        spec,
        _embedded_command(),
        skip=[chief],
        env=local_threads(spec),
        log_dir=job.model_dir / "logs",
        max_restarts=strategy.max_restarts,
        restart_backoff_s=strategy.restart_backoff_s,
        hung_timeout_s=strategy.hung_timeout_s,
        # The roles run this script too: what it imported so far, they import from the zygote.
        preload=installed_modules(),
    )
    # The launcher appends roles that fail for good (out of restarts, or not restartable); the chief's loop reads
    # it on every poll.
    failures: list[RoleExit] = []
    main_thread = threading.main_thread().ident
    # SIGTERM or Ctrl-C to this process preempts the whole job (a checkpoint at the current step); the roles end
    # when the chief says the job is over.
    preemption = Preemption(strategy.termination_grace_s).install(ctrl_c=lambda: not failures)

    def on_failure(exit_: RoleExit) -> None:
        failures.append(exit_)
        # A real signal, so that a wait inside C code in the main thread is interrupted too; the chief's loop also
        # reads `failures` on every poll, in case the interruption lands where it is lost. Once preempted, the
        # chief's loop alone reacts, so that no interruption lands in the final checkpoint.
        if main_thread is not None and not preemption.requested:
            signal.pthread_kill(main_thread, signal.SIGINT)

    control: ControlPlane | None = None  # the chief's, served until every role has exited
    try:
        # Before the roles start: connecting to it is the first thing each does.
        control = _connect(job, spec, chief).control
        with launcher:
            launcher.start()
            launcher.watch(on_failure)
            try:
                result = _run_chief(job, spec, chief, on_connect, failures, preemption, control)
            except Preempted:
                # Every role was told the job is over; those not gone shortly before the deadline are stopped.
                margin_s = min(1.0, strategy.termination_grace_s / 10)
                with contextlib.suppress(TimeoutError):
                    launcher.wait(timeout_s=max(0.0, preemption.remaining_s() - margin_s))
                launcher.stop(grace_s=min(margin_s, preemption.remaining_s()) / 2)
                raise
            leftover = launcher.wait(timeout_s=strategy.request_timeout_s)
            if leftover is not None:
                raise RoleFailedError(f"{leftover.describe()} after training finished")
    finally:
        preemption.uninstall()
        if control is not None:
            control.close()
    return result
