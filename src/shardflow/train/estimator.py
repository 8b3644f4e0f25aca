"""`Estimator` and `train_and_evaluate`: the same program in every process, each doing its role's part."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from shardflow import env
from shardflow.cluster import control_keys
from shardflow.cluster.launcher import LocalLauncher, RoleExit, local_threads
from shardflow.cluster.rendezvous import ControlPlane, ControlPlaneError
from shardflow.cluster.spec import ClusterSpec, TaskSpec, cluster_from_env
from shardflow.cluster.zygote import exit_without_final_collection, installed_modules
from shardflow.comm.errors import CommError
from shardflow.comm.security import new_secret
from shardflow.profile.capture import check_steps
from shardflow.ps.client import ParameterClient
from shardflow.ps.optimizers import SGD, OptimizerLike, as_optimizer_spec
from shardflow.ps.schedules import ScheduleLike, as_schedule
from shardflow.train import checkpoint
from shardflow.train.chief import run_chief
from shardflow.train.evaluator import run_evaluator
from shardflow.train.job import JobConfig, LossFn, ModelFn, RoleFailedError, build_model, evaluate_model
from shardflow.train.preemption import Preemption, tell_chief
from shardflow.train.progress import chief_prefix
from shardflow.train.ps_role import run_ps
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import EvalSpec, Preempted, TrainResult, TrainSpec
from shardflow.train.strategy import ParameterServerStrategy
from shardflow.train.worker import JobOver, PSRestored, recovery_generation, run_worker

log = logging.getLogger(__name__)

__all__ = ["Estimator", "Preempted", "RoleFailedError", "train_and_evaluate"]


class Estimator:
    """A model, its loss, its optimizer (applied on the PS) and how training is distributed.

    Every parameter of the model is a variable on the PS, cut along dim 0 by the strategy's partitioner. The
    weight of an `nn.Embedding` or `nn.EmbeddingBag` with `sparse=True` is row-sparse: a step fetches and pushes
    only the rows its batch looks up. Its optimizer must have a sparse form: SGD without momentum, Adagrad or Adam
    (applied lazily, as SparseAdam), without weight_decay; any other is refused when the job starts."""

    def __init__(
        self,
        model_fn: ModelFn,
        loss_fn: LossFn,
        optimizer: OptimizerLike | None = None,
        strategy: ParameterServerStrategy | None = None,
        model_dir: str | os.PathLike[str] = "runs/model",
        *,
        seed: int = 0,
        lr_schedule: ScheduleLike | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        profile_steps: tuple[int, int] | None = None,
        profile_ops: bool = False,
        save_checkpoints_steps: int | None = None,
        save_checkpoints_secs: float | None = 600.0,
        keep_checkpoint_max: int | None = 5,
        save_summary_steps: int = 100,
    ) -> None:
        """`model_fn`: a function building the model, or an `nn.Module` (copied for each role). `optimizer`:
        `sf.optim.Adam(...)`, or a torch.optim class or `functools.partial(torch.optim.Adam, lr=...)`; applied on
        the PS. `lr_schedule`: a torch.optim.lr_scheduler class or `functools.partial` of one, applied on the PS
        by global step. `clip_grad_norm` / `clip_grad_value`: each update's gradient clipped as
        `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` would in one process (ps/clipping.py)."""
        if not callable(model_fn):
            raise ValueError("Estimator.model_fn must be a callable returning a torch.nn.Module, or a torch.nn.Module")
        if not callable(loss_fn):
            raise ValueError("Estimator.loss_fn must be a callable (model, batch) -> scalar tensor")
        if not (isinstance(save_summary_steps, int) and not isinstance(save_summary_steps, bool)) or (
            save_summary_steps < 1
        ):
            raise ValueError(f"Estimator.save_summary_steps must be an int >= 1, got {save_summary_steps!r}")
        self.model_fn = model_fn
        self.loss_fn = loss_fn
        spec = as_optimizer_spec(optimizer) if optimizer is not None else SGD(lr=0.01)
        self.optimizer = dataclasses.replace(
            spec,
            schedule=as_schedule(lr_schedule) if lr_schedule is not None else spec.schedule,
            clip_grad_norm=clip_grad_norm if clip_grad_norm is not None else spec.clip_grad_norm,
            clip_grad_value=clip_grad_value if clip_grad_value is not None else spec.clip_grad_value,
        )
        """The optimizer the PS apply, with its learning-rate schedule and gradient clipping."""
        self.save_summary_steps = save_summary_steps
        """TensorBoard training scalars at every multiple of this global step, and at the last."""
        self.strategy = strategy or ParameterServerStrategy()
        # Tools (shardflow scale) point each run at its own directory and capture window.
        self.model_dir = Path(env.get(env.MODEL_DIR) or model_dir)
        self.seed = seed
        profile_steps = env.profile_steps() or profile_steps
        if profile_steps is not None:
            profile_steps = check_steps(profile_steps, what="Estimator.profile_steps")
        self.profile_steps = profile_steps
        """Global steps [first, last) captured on every role into model_dir/profile/."""
        self.profile_ops = profile_ops
        """Also record torch ops, shapes, memory and Python source in the capture (costly; off by default)."""
        for name, value in (
            ("save_checkpoints_steps", save_checkpoints_steps),
            ("keep_checkpoint_max", keep_checkpoint_max),
        ):
            if value is not None and value < 1:
                raise ValueError(f"Estimator.{name} must be >= 1 or None, got {value}")
        if save_checkpoints_secs is not None and save_checkpoints_secs <= 0:
            raise ValueError(f"Estimator.save_checkpoints_secs must be positive or None, got {save_checkpoints_secs}")
        self.save_checkpoints_steps = save_checkpoints_steps
        """Checkpoint exactly at every multiple of this global step (then save_checkpoints_secs is ignored)."""
        self.save_checkpoints_secs = save_checkpoints_secs
        """Checkpoint at most this often; a final checkpoint is always written."""
        self.keep_checkpoint_max = keep_checkpoint_max
        """Keep only the newest checkpoints; None keeps all."""
        # The client of this process's role while it trains, so that global_step reads the live value.
        self._live_parameters: ParameterClient | None = None

    def build_model(self) -> torch.nn.Module:
        """The model as model_fn builds it, with the same initial values in every process."""
        return build_model(self.model_fn, self.seed)

    def job(self, train_spec: TrainSpec, eval_spec: EvalSpec | None = None) -> JobConfig:
        """The job every role of a run receives."""
        return JobConfig(
            model_fn=self.model_fn,
            loss_fn=self.loss_fn,
            optimizer=self.optimizer,
            strategy=self.strategy,
            model_dir=self.model_dir,
            seed=self.seed,
            train_spec=train_spec,
            eval_spec=eval_spec,
            profile_steps=self.profile_steps,
            profile_ops=self.profile_ops,
            save_checkpoints_steps=self.save_checkpoints_steps,
            save_checkpoints_secs=self.save_checkpoints_secs,
            keep_checkpoint_max=self.keep_checkpoint_max,
            save_summary_steps=self.save_summary_steps,
        )

    def _set_live(self, client: ParameterClient | None) -> None:
        self._live_parameters = client

    def train(self, input_fn: Any, max_steps: int | None = None, epochs: int | None = None) -> TrainResult:
        """Train without evaluation; returns in the chief, exits the process in every other role."""
        return train_and_evaluate(self, TrainSpec(input_fn, max_steps=max_steps, epochs=epochs), None)

    @property
    def global_step(self) -> int:
        """The latest global step: live from ps:0 while this process takes part in training, else the checkpoint's."""
        if self._live_parameters is not None:
            return self._live_parameters.global_step()
        path = checkpoint.latest(self.model_dir)
        return 0 if path is None else int(checkpoint.load(path)[1]["global_step"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained parameters from the latest checkpoint in model_dir, as a plain state_dict."""
        path = checkpoint.latest(self.model_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {self.model_dir}/checkpoints; train first")
        return checkpoint.load_state(path)[0].params

    def evaluate(self, eval_spec: EvalSpec, checkpoint_path: str | os.PathLike[str] | None = None) -> dict[str, float]:
        """Evaluate a checkpoint (the latest by default) in this process."""
        model = self.build_model()
        if checkpoint_path is None:
            model.load_state_dict(self.state_dict())
        else:
            model.load_state_dict(checkpoint.load_state(checkpoint_path)[0].params)
        return self.evaluate_model(model, eval_spec)

    def evaluate_model(self, model: torch.nn.Module, eval_spec: EvalSpec) -> dict[str, float]:
        """The mean loss and metrics of `model` over the evaluation input, in this process."""
        return evaluate_model(model, self.loss_fn, eval_spec)


def train_and_evaluate(est: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec | None = None) -> TrainResult:
    """Run this process's role. Returns the result in the chief; other roles exit the process when the job is done."""
    job = est.job(train_spec, eval_spec)
    finished = _already_finished(job)
    found = cluster_from_env(num_ps=job.strategy.num_ps, num_workers=job.strategy.num_workers)
    if finished is not None:
        if found is None or found[1].type == "chief":
            return finished
        sys.stdout.flush()
        raise SystemExit(0)
    # A role's process imported torch and what the job needs: without this its exit takes seconds.
    exit_without_final_collection()
    if found is None:
        return _run_embedded(est, job)
    spec, task = found
    if task.type == "chief":
        return _run_chief(est, job, spec, task)
    _run_other_role(est, job, spec, task)


def _already_finished(job: JobConfig) -> TrainResult | None:
    """What the latest checkpoint holds when it is already at max_steps: a re-run then trains nothing and starts
    no cluster."""
    max_steps = job.train_spec.max_steps
    path = checkpoint.latest(job.model_dir) if max_steps is not None else None
    if max_steps is None or path is None:
        return None
    manifest = checkpoint.read_manifest(path)
    step = int(manifest["global_step"])
    if step < max_steps:
        return None
    log.warning(
        "model_dir %s already holds global step %d >= max_steps %d; raise max_steps to train further",
        job.model_dir,
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


def _connect(job: JobConfig, spec: ClusterSpec, task: TaskSpec) -> RoleContext:
    if spec.num("ps") < 1:
        raise ValueError("the cluster has no 'ps' tasks; parameter-server training needs at least one")
    if spec.num("worker") < 1:
        raise ValueError("the cluster has no 'worker' tasks; training needs at least one")
    chief = spec.address(TaskSpec("chief", 0))
    control = ControlPlane(chief, is_chief=task.type == "chief", timeout_s=job.strategy.startup_timeout_s)
    return RoleContext(spec, task, control)


def _run_chief(
    est: Estimator,
    job: JobConfig,
    spec: ClusterSpec,
    task: TaskSpec,
    failures: Sequence[RoleExit] = (),
    preemption: Preemption | None = None,
    control: ControlPlane | None = None,
) -> TrainResult:
    """Raises Preempted, after the final checkpoint, when SIGTERM (or a role's preemption) ended training early.
    `control`: the chief's control plane, served by the caller past the return, while the roles read that the job
    is over; by default this connects, and serves it until every role said goodbye."""
    own_preemption = preemption is None
    if preemption is None:
        preemption = Preemption(job.strategy.termination_grace_s).install()
    role = _connect(job, spec, task) if control is None else RoleContext(spec, task, control)
    log_handlers = _log_to(job.model_dir / "logs" / "chief.log")
    try:
        result = run_chief(job, role, failures=failures, on_connect=est._set_live, preemption=preemption)
        _write_result(job, role, result)
        if result.preempted:
            raise Preempted(result)
        return result
    except KeyboardInterrupt:
        if not failures:
            raise
        failed = failures[0]
        key = control_keys.failed(failed.task.name)
        reason = role.control.get(key, waiting_for=failed.task.name) if role.control.is_set(key) else ""
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
    """Wait (briefly) until every other role has said it saw the end of the job, or is gone."""
    others = [control_keys.goodbye(task.name) for task in role.spec.tasks() if task != role.task]
    try:
        role.control.wait(others, waiting_for="every role to see the end of the job", timeout_s=timeout_s)
    except ControlPlaneError:
        missing = [key for key in others if not role.control.is_set(key)]
        log.info("the chief ends without goodbyes from %s (gone already, or still finishing)", ", ".join(missing))


def _run_other_role(est: Estimator, job: JobConfig, spec: ClusterSpec, task: TaskSpec) -> NoReturn:
    threads = env.get_int(env.LOCAL_THREADS)
    if threads:
        torch.set_num_threads(threads)
    role = _connect(job, spec, task)
    # On SIGTERM the role asks the chief to end the job at the current step and carries on until it is over:
    # the process then exits 0 as at any end, or 143 at the deadline if the job never ends.
    Preemption(job.strategy.termination_grace_s).install(tell_chief(role))
    try:
        if task.type == "ps":
            run_ps(role)
        elif task.type == "worker":
            _run_worker_until_the_end(est, job, role)
        elif task.type == "evaluator":
            run_evaluator(job, role)
    except Exception as error:
        if task.type == "worker" and not isinstance(error, ControlPlaneError):  # else the chief cannot hear it
            with contextlib.suppress(ControlPlaneError):
                role.control.set(control_keys.failed(task.name), f"{type(error).__name__}: {error}")
        raise
    with contextlib.suppress(ControlPlaneError):
        role.control.set(control_keys.goodbye(task.name), "1")
    role.control.close()
    sys.stdout.flush()
    raise SystemExit(0)


def _run_worker_until_the_end(est: Estimator, job: JobConfig, role: RoleContext) -> None:
    """Train; then stay until the chief says the job is over, reading the shards of workers lost for good that the
    chief hands over. Whenever the PS are restored after one was lost, even once this worker has finished its
    input, it starts again from where the PS now say it stands."""
    adopted: list[RoleContext] = []
    finished: set[str] = set()
    """Of this worker and those it adopted, the ones done with the current recovery generation."""
    while True:
        generation = recovery_generation(role)
        try:
            for each in (role, *adopted):
                if each.task.name not in finished:
                    run_worker(job, each, on_connect=est._set_live)
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


def _log_to(path: Path) -> list[logging.Handler]:
    """The chief's log records also go to model_dir/logs/chief.log, beside the other roles' logs; its warnings
    (a worker lost, restarted, preempted) also to stderr, as every other role's do, unless the program set up
    logging itself."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
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


def _write_result(job: JobConfig, role: RoleContext, result: TrainResult) -> None:
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


def _run_embedded(est: Estimator, job: JobConfig) -> TrainResult:
    """No cluster in the environment: this process becomes the chief and starts the other roles itself."""
    strategy = job.strategy
    spec = ClusterSpec.local(num_workers=strategy.num_workers, num_ps=strategy.num_ps, evaluator=strategy.evaluator)
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
        # The roles run this script too: what it imported so far, they import from the zygote.
        preload=installed_modules(),
    )
    # The launcher appends roles that fail for good (out of restarts, or not restartable); the chief's loop reads
    # it on every poll.
    failures: list[RoleExit] = []
    main_thread = threading.main_thread().ident
    # SIGTERM to this process preempts the whole job; the roles end when the chief says the job is over.
    preemption = Preemption(strategy.termination_grace_s).install()

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
                result = _run_chief(est, job, spec, chief, failures, preemption, control)
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
