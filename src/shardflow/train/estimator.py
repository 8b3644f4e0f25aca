"""`Estimator` and `train_and_evaluate`: the same program in every process, each doing its role's part."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from shardflow import env
from shardflow.profile.capture import check_steps
from shardflow.ps.connection import PSConnection
from shardflow.ps.optimizers import SGD, OptimizerLike, OptimizerSpec, as_optimizer_spec
from shardflow.ps.schedules import ScheduleLike, as_schedule
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.saved_tables import saved_tables
from shardflow.train.evaluation import evaluate_model
from shardflow.train.job import JobConfig, LossFn, ModelFn, RoleFailedError, build_model
from shardflow.train.launch import run_process
from shardflow.train.specs import EvalSpec, Preempted, TrainResult, TrainSpec
from shardflow.train.strategy import ParameterServerStrategy, Strategy

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
        strategy: Strategy | None = None,
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
        full_checkpoint_every: int = 10,
    ) -> None:
        """`model_fn`: a function building the model, or an `nn.Module` (copied for each role). `optimizer`:
        `sf.optim.Adam(...)`, or a torch.optim class or `functools.partial(torch.optim.Adam, lr=...)`; applied on
        the PS. `lr_schedule`: a torch.optim.lr_scheduler class or `functools.partial` of one, applied on the PS
        by global step. `clip_grad_norm` / `clip_grad_value`: each update's gradient clipped as
        `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` would in one process (ps/clipping.py).
        `full_checkpoint_every`: every this many checkpoints each PS writes every row of its `sf.nn` tables; in
        between, only the rows changed since the checkpoint before."""
        _check_arguments(
            model_fn,
            loss_fn,
            save_summary_steps=save_summary_steps,
            save_checkpoints_steps=save_checkpoints_steps,
            save_checkpoints_secs=save_checkpoints_secs,
            keep_checkpoint_max=keep_checkpoint_max,
            full_checkpoint_every=full_checkpoint_every,
        )
        self.full_checkpoint_every = full_checkpoint_every
        self.model_fn = model_fn
        self.loss_fn = loss_fn
        self.optimizer = _optimizer(optimizer, lr_schedule, clip_grad_norm, clip_grad_value)
        """The optimizer the PS apply, with its learning-rate schedule and gradient clipping."""
        self.save_summary_steps = save_summary_steps
        """TensorBoard training scalars at every multiple of this global step, and at the last."""
        self.strategy: Strategy = strategy or ParameterServerStrategy()
        # Tools (shardflow scale) point each run at its own directory and capture window.
        self.model_dir = Path(env.get(env.MODEL_DIR) or model_dir)
        self.seed = seed
        self.profile_steps = _profile_steps(profile_steps)
        """Global steps [first, last) captured on every role into model_dir/profile/."""
        self.profile_ops = profile_ops
        """Also record torch ops, shapes, memory and Python source in the capture (costly; off by default)."""
        self.save_checkpoints_steps = save_checkpoints_steps
        """Checkpoint exactly at every multiple of this global step (then save_checkpoints_secs is ignored)."""
        self.save_checkpoints_secs = save_checkpoints_secs
        """Checkpoint at most this often; a final checkpoint is always written."""
        self.keep_checkpoint_max = keep_checkpoint_max
        """Keep only the newest checkpoints; None keeps all."""
        # The client of this process's role while it trains, so that global_step reads the live value.
        self._live_parameters: PSConnection | None = None

    def build_model(self) -> torch.nn.Module:
        """The model as model_fn builds it, with the same initial values in every process."""
        return build_model(self.model_fn, self.seed)

    def job(self, train_spec: TrainSpec, eval_spec: EvalSpec | None = None) -> JobConfig[Strategy]:
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
            full_checkpoint_every=self.full_checkpoint_every,
            save_summary_steps=self.save_summary_steps,
        )

    def _set_live(self, client: PSConnection | None) -> None:
        self._live_parameters = client

    def train(self, input_fn: Any, max_steps: int | None = None, epochs: int | None = None) -> TrainResult:
        """Train without evaluation; returns in the chief, exits the process in every other role."""
        return train_and_evaluate(self, TrainSpec(input_fn, max_steps=max_steps, epochs=epochs), None)

    @property
    def global_step(self) -> int:
        """The latest global step: live from ps:0 while this process takes part in training, else the checkpoint's."""
        if self._live_parameters is not None:
            return self._live_parameters.global_step()
        return store.latest_step(self.model_dir)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained parameters from the latest checkpoint in model_dir, as a plain state_dict."""
        path = store.latest(self.model_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {store.directory(self.model_dir)}; train first")
        return store.load_state(path)[0].params

    def evaluate(self, eval_spec: EvalSpec, checkpoint_path: str | os.PathLike[str] | None = None) -> dict[str, float]:
        """Evaluate a checkpoint (the latest by default) in this process."""
        model = self.build_model()
        path = checkpoint_path if checkpoint_path is not None else store.latest(self.model_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {store.directory(self.model_dir)}; train first")
        state = store.load_state(path)[0]
        model.load_state_dict(state.params)
        with saved_tables(model, state, self.model_dir):
            return self.evaluate_model(model, eval_spec)

    def evaluate_model(self, model: torch.nn.Module, eval_spec: EvalSpec) -> dict[str, float]:
        """The loss and metrics of `model` over the whole evaluation input, in this process."""
        return evaluate_model(model, self.loss_fn, eval_spec)


def train_and_evaluate(est: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec | None = None) -> TrainResult:
    """Run this process's role. Returns the result in the chief; other roles exit the process when the job is done."""
    return run_process(est.job(train_spec, eval_spec), on_connect=est._set_live)


def _profile_steps(given: tuple[int, int] | None) -> tuple[int, int] | None:
    """The capture window: the environment's (a tool's), else the one given, checked."""
    steps = env.profile_steps() or given
    return check_steps(steps, what="Estimator.profile_steps") if steps is not None else None


def _check_arguments(
    model_fn: ModelFn,
    loss_fn: LossFn,
    *,
    save_summary_steps: int,
    save_checkpoints_steps: int | None,
    save_checkpoints_secs: float | None,
    keep_checkpoint_max: int | None,
    full_checkpoint_every: int = 10,
) -> None:
    """The Estimator's arguments that it stores as given: a ValueError names the one to change."""
    if not callable(model_fn):
        raise ValueError("Estimator.model_fn must be a callable returning a torch.nn.Module, or a torch.nn.Module")
    if not callable(loss_fn):
        raise ValueError("Estimator.loss_fn must be a callable (model, batch) -> scalar tensor")
    if not (isinstance(save_summary_steps, int) and not isinstance(save_summary_steps, bool)) or (
        save_summary_steps < 1
    ):
        raise ValueError(f"Estimator.save_summary_steps must be an int >= 1, got {save_summary_steps!r}")
    for name, value in (
        ("save_checkpoints_steps", save_checkpoints_steps),
        ("keep_checkpoint_max", keep_checkpoint_max),
        ("full_checkpoint_every", full_checkpoint_every),
    ):
        if value is not None and value < 1:
            raise ValueError(f"Estimator.{name} must be >= 1 or None, got {value}")
    if save_checkpoints_secs is not None and save_checkpoints_secs <= 0:
        raise ValueError(f"Estimator.save_checkpoints_secs must be positive or None, got {save_checkpoints_secs}")


def _optimizer(
    optimizer: OptimizerLike | None,
    lr_schedule: ScheduleLike | None,
    clip_grad_norm: float | None,
    clip_grad_value: float | None,
) -> OptimizerSpec:
    """The optimizer's spec (SGD(lr=0.01) by default), with the Estimator's schedule and clipping where given."""
    spec = as_optimizer_spec(optimizer) if optimizer is not None else SGD(lr=0.01)
    return dataclasses.replace(
        spec,
        schedule=as_schedule(lr_schedule) if lr_schedule is not None else spec.schedule,
        clip_grad_norm=clip_grad_norm if clip_grad_norm is not None else spec.clip_grad_norm,
        clip_grad_value=clip_grad_value if clip_grad_value is not None else spec.clip_grad_value,
    )
