"""`Estimator` and `train_and_evaluate`: the same program in every process, each doing its role's part."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from shardflow.cluster.launcher import THREADS_ENV, LocalLauncher, RoleExit, local_threads
from shardflow.cluster.rendezvous import ControlPlane
from shardflow.cluster.spec import ClusterSpec, TaskSpec, cluster_from_env
from shardflow.ps.client import ParameterClient
from shardflow.ps.optimizers import SGD, OptimizerSpec
from shardflow.train import checkpoint
from shardflow.train.batches import to_torch
from shardflow.train.chief import run_chief
from shardflow.train.roles import RoleContext, run_evaluator, run_ps
from shardflow.train.specs import EvalSpec, InputContext, TrainResult, TrainSpec
from shardflow.train.strategy import ParameterServerStrategy
from shardflow.train.worker import run_worker

log = logging.getLogger(__name__)

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class RoleFailedError(RuntimeError):
    """A process of the local cluster exited with an error; the message names its role and exit code."""


class Estimator:
    """A model, its loss, its optimizer (applied on the PS) and how training is distributed.

    Every parameter of the model is a variable on the PS, cut along dim 0 by the strategy's partitioner. The
    weight of an `nn.Embedding` or `nn.EmbeddingBag` with `sparse=True` is row-sparse: a step fetches and pushes
    only the rows its batch looks up. Its optimizer must have a sparse form: SGD without momentum, Adagrad or Adam
    (applied lazily, as SparseAdam), without weight_decay; any other is refused when the job starts."""

    def __init__(
        self,
        model_fn: Callable[[], torch.nn.Module],
        loss_fn: LossFn,
        optimizer: OptimizerSpec | None = None,
        strategy: ParameterServerStrategy | None = None,
        model_dir: str | os.PathLike[str] = "runs/model",
        *,
        seed: int = 0,
        profile_steps: tuple[int, int] | None = None,
        profile_ops: bool = False,
        save_checkpoints_steps: int | None = None,
        save_checkpoints_secs: float | None = 600.0,
        keep_checkpoint_max: int | None = 5,
    ) -> None:
        if not callable(model_fn):
            raise ValueError("Estimator.model_fn must be a callable returning a torch.nn.Module")
        if not callable(loss_fn):
            raise ValueError("Estimator.loss_fn must be a callable (model, batch) -> scalar tensor")
        self.model_fn = model_fn
        self.loss_fn = loss_fn
        self.optimizer = optimizer or SGD(lr=0.01)
        self.strategy = strategy or ParameterServerStrategy()
        # Tools (shardflow scale) point each run at its own directory and capture window.
        self.model_dir = Path(os.environ.get("SHARDFLOW_MODEL_DIR") or model_dir)
        self.seed = seed
        if os.environ.get("SHARDFLOW_PROFILE_STEPS"):
            first, _, last = os.environ["SHARDFLOW_PROFILE_STEPS"].partition(",")
            profile_steps = (int(first), int(last))
        if profile_steps is not None and not (len(profile_steps) == 2 and 0 <= profile_steps[0] < profile_steps[1]):
            raise ValueError(
                f"Estimator.profile_steps must be (first, last) with 0 <= first < last, got {profile_steps}"
            )
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
        self._live_parameters: ParameterClient | None = None
        # The embedded cluster's launcher appends roles that exited with an error; the chief's loop checks it.
        self._role_failures: list[RoleExit] = []

    def build_model(self) -> torch.nn.Module:
        """The model as model_fn builds it, with the same initial values in every process."""
        torch.manual_seed(self.seed)
        model = self.model_fn()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"Estimator.model_fn must return a torch.nn.Module, got {type(model).__name__}")
        return model

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
        totals: dict[str, float] = {"loss": 0.0, **dict.fromkeys(eval_spec.metrics, 0.0)}
        num_batches = 0
        model.eval()
        with torch.no_grad():
            for batch in eval_spec.input_fn(InputContext(1, 0)):
                if eval_spec.steps is not None and num_batches >= eval_spec.steps:
                    break
                batch = to_torch(batch)
                totals["loss"] += float(self.loss_fn(model, batch))
                for name, fn in eval_spec.metrics.items():
                    totals[name] += float(fn(model, batch))
                num_batches += 1
        model.train()
        return {k: v / max(num_batches, 1) for k, v in totals.items()}


def train_and_evaluate(est: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec | None = None) -> TrainResult:
    """Run this process's role. Returns the result in the chief; other roles exit the process when the job is done."""
    found = cluster_from_env(num_ps=est.strategy.num_ps)
    if found is None:
        return _run_embedded(est, train_spec, eval_spec)
    spec, task = found
    if task.type == "chief":
        return _run_chief(est, train_spec, eval_spec, spec, task)
    _run_other_role(est, train_spec, eval_spec, spec, task)


def _connect(est: Estimator, spec: ClusterSpec, task: TaskSpec) -> RoleContext:
    if spec.num("ps") < 1:
        raise ValueError("the cluster has no 'ps' tasks; parameter-server training needs at least one")
    if spec.num("worker") < 1:
        raise ValueError("the cluster has no 'worker' tasks; training needs at least one")
    chief = spec.address(TaskSpec("chief", 0))
    control = ControlPlane(chief, is_chief=task.type == "chief", timeout_s=est.strategy.startup_timeout_s)
    return RoleContext(spec, task, control)


def _run_chief(
    est: Estimator,
    train_spec: TrainSpec,
    eval_spec: EvalSpec | None,
    spec: ClusterSpec,
    task: TaskSpec,
    failures: list[RoleExit] | None = None,
) -> TrainResult:
    role = _connect(est, spec, task)
    log_handler = _log_to(est.model_dir / "logs" / "chief.log")
    try:
        result = run_chief(est, train_spec, eval_spec, role)
        _write_result(est, role, result)
        return result
    except KeyboardInterrupt:
        if not failures:
            raise
        failed = failures[0]
        key = f"failed/{failed.task.name}"
        reason = role.control.get(key, waiting_for=failed.task.name) if role.control.is_set(key) else ""
        raise RoleFailedError(f"{failed.describe()}{': ' + reason if reason else ''}; the job was stopped") from None
    finally:
        # Tell every role the job is over so none waits for a chief that is gone.
        role.control.set("shutdown", "1")
        logging.getLogger("shardflow").removeHandler(log_handler)
        log_handler.close()


def _run_other_role(
    est: Estimator,
    train_spec: TrainSpec,
    eval_spec: EvalSpec | None,
    spec: ClusterSpec,
    task: TaskSpec,
) -> NoReturn:
    if os.environ.get(THREADS_ENV):
        torch.set_num_threads(int(os.environ[THREADS_ENV]))
    role = _connect(est, spec, task)
    try:
        if task.type == "ps":
            run_ps(role)
        elif task.type == "worker":
            run_worker(est, train_spec, role)
        elif task.type == "evaluator":
            run_evaluator(est, eval_spec, role)
    except Exception as error:
        if task.type == "worker":
            role.control.set(f"failed/{task.name}", f"{type(error).__name__}: {error}")
        raise
    sys.stdout.flush()
    raise SystemExit(0)


def _log_to(path: Path) -> logging.Handler:
    """The chief's log records also go to model_dir/logs/chief.log, beside the other roles' logs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("shardflow")
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


def _write_result(est: Estimator, role: RoleContext, result: TrainResult) -> None:
    """SHARDFLOW_RESULT_JSON: where tools such as `shardflow scale` read what the run did."""
    path = os.environ.get("SHARDFLOW_RESULT_JSON")
    if not path:
        return
    fields = ("global_step", "training_s", "elapsed_s", "worker_steps", "metrics", "eval_history", "profile_dir")
    payload = {name: getattr(result, name) for name in fields}
    payload.update(num_workers=role.num_workers, num_ps=role.num_ps, mode=est.strategy.mode)
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


def _run_embedded(est: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec | None) -> TrainResult:
    """No cluster in the environment: this process becomes the chief and starts the other roles itself."""
    strategy = est.strategy
    spec = ClusterSpec.local(num_workers=strategy.num_workers, num_ps=strategy.num_ps, evaluator=strategy.evaluator)
    chief = TaskSpec("chief", 0)
    launcher = LocalLauncher(
        spec,
        _embedded_command(),
        skip=[chief],
        env=local_threads(spec),
        log_dir=est.model_dir / "logs",
    )
    failures: list[RoleExit] = []
    est._role_failures = failures
    main_thread = threading.main_thread().ident

    def on_failure(exit_: RoleExit) -> None:
        failures.append(exit_)
        # A real signal, so that a wait inside C code in the main thread is interrupted too; the chief's loop also
        # reads `failures` on every poll, in case the interruption lands where it is lost.
        if main_thread is not None:
            signal.pthread_kill(main_thread, signal.SIGINT)

    with launcher:
        launcher.start()
        launcher.watch(on_failure)
        result = _run_chief(est, train_spec, eval_spec, spec, chief, failures)
        leftover = launcher.wait(timeout_s=strategy.request_timeout_s)
        if leftover is not None:
            raise RoleFailedError(f"{leftover.describe()} after training finished")
    return result
