"""The user's specs: what to train on, for how long, and what to evaluate."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch

from shardflow.cluster.launcher import PREEMPTED_EXIT_CODE
from shardflow.metrics import Metric
from shardflow.train.hooks import Hook

InputFn = Callable[["InputContext"], Iterable[Any]]
MetricFn = Callable[[torch.nn.Module, Any], Any]
MetricSpec = MetricFn | tuple[Metric, MetricFn]
"""fn(model, batch) returning values to average, or a pair (metric, fn) where fn returns the arguments of
metric.update (docs/training.md, "Evaluation metrics")."""


@dataclass(frozen=True)
class InputContext:
    """Which slice of the input this process reads: shard with `num_workers` and `worker_index`."""

    num_workers: int = 1
    worker_index: int = 0
    epoch: int = 0
    """The epoch (0-based) this call of input_fn produces, e.g. for DistributedSampler.set_epoch or
    TorchIterable.set_epoch; 0 for evaluation."""

    @property
    def num_input_pipelines(self) -> int:
        return self.num_workers

    @property
    def input_pipeline_id(self) -> int:
        return self.worker_index


@dataclass(frozen=True)
class TrainSpec:
    """Training length: `max_steps` global steps, or `epochs` passes over the data across the whole cluster."""

    input_fn: InputFn
    """Called once per epoch on every worker with its InputContext; returns an iterable of batches."""
    _: KW_ONLY
    max_steps: int | None = None
    """Stop at this global step (exact: the PS apply no update beyond it)."""
    epochs: int | None = None
    """Every record is seen this many times across all workers: input_fn shards by ctx.worker_index, or returns a
    shardflow.data.Dataset, which each worker auto-shards (see train/input_sharding.py)."""
    hooks: Sequence[Hook] = ()
    """Per-step logic run in every worker (see shardflow.train.hooks.Hook)."""
    allow_empty_input: bool = False
    """Let a worker whose input yields nothing in its first epoch train no step; by default that fails the job,
    naming the worker (a glob that matches no file, a shard with nothing in it)."""

    def __post_init__(self) -> None:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("TrainSpec needs max_steps=... or epochs=... (or both; whichever ends first)")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"TrainSpec.max_steps must be >= 0, got {self.max_steps}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"TrainSpec.epochs must be >= 1, got {self.epochs}")


@dataclass(frozen=True)
class EvalSpec:
    """Evaluation after training, and during it if asked (on the chief, or the side-car evaluator): the loss and each
    metric over the whole evaluation input, streamed batch by batch and computed once at the end."""

    input_fn: InputFn
    """Called with InputContext(1, 0); returns an iterable of batches."""
    _: KW_ONLY
    steps: int | None = None
    """Evaluate at most this many batches; None means the whole input."""
    metrics: Mapping[str, MetricSpec] = field(default_factory=dict)
    """name -> fn(model, batch) returning per-example values (a tensor, each element counted once) or the batch's
    mean (a number, weighted by the batch size), averaged over every example; or name -> (metric, fn): metric has
    update/compute/reset (sf.metrics.AUC(), a torchmetrics Metric), fn(model, batch) returns update's arguments (a
    tuple, or one value), and the result is metric.compute() over the whole input."""
    every_n_steps: int | None = None
    """Also evaluate while training, each time the global step passes a multiple of this."""
    every_n_secs: float | None = None
    """Also evaluate while training, at most this often."""
    early_stopping: EarlyStopping | None = None
    """Stop training when an evaluated metric stops improving."""

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"EvalSpec.steps must be >= 1 or None (the whole input), got {self.steps}")
        for name, spec in self.metrics.items():
            _check_metric(name, spec)
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ValueError(f"EvalSpec.every_n_steps must be >= 1, got {self.every_n_steps}")
        if self.every_n_secs is not None and self.every_n_secs <= 0:
            raise ValueError(f"EvalSpec.every_n_secs must be positive, got {self.every_n_secs}")
        if self.early_stopping is not None and self.every_n_steps is None and self.every_n_secs is None:
            raise ValueError(
                "EvalSpec.early_stopping needs every_n_steps or every_n_secs, so evaluation runs during training"
            )


def _check_metric(name: str, spec: object) -> None:
    where = f"EvalSpec.metrics[{name!r}]"
    if name == "loss":
        raise ValueError("EvalSpec.metrics cannot name a metric 'loss': the loss_fn's mean is always there as 'loss'")
    if isinstance(spec, tuple):
        if len(spec) != 2 or not isinstance(spec[0], Metric) or not callable(spec[1]):
            raise ValueError(
                f"{where} is a tuple, so it must be a pair (metric, fn): a metric with update/compute/reset and "
                "fn(model, batch) returning the arguments of its update"
            )
    elif isinstance(spec, Metric):
        raise ValueError(
            f"{where} is a metric with no function to feed it: give the pair ({type(spec).__name__}(...), fn), "
            "where fn(model, batch) returns the arguments of its update"
        )
    elif not callable(spec):
        raise ValueError(f"{where} must be fn(model, batch) or a pair (metric, fn), got {type(spec).__name__}")


@dataclass(frozen=True, kw_only=True)
class EarlyStopping:
    """Stop when `metric` has not improved by `min_delta` for `patience` evaluations in a row."""

    metric: str = "loss"
    """The EvalSpec metric to watch ("loss" is always there)."""
    mode: str = "min"
    """"min" if lower is better, "max" if higher is better."""
    patience: int = 3
    """Evaluations without improvement before stopping."""
    min_delta: float = 0.0
    """The least change that counts as an improvement."""

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping.mode must be 'min' or 'max', got {self.mode!r}")
        if self.patience < 1:
            raise ValueError(f"EarlyStopping.patience must be >= 1, got {self.patience}")

    def should_stop(self, history: Sequence[float]) -> bool:
        """Whether the last `patience` values all failed to beat the best one before them."""
        if len(history) <= self.patience:
            return False
        best_before = min(history[: -self.patience]) if self.mode == "min" else max(history[: -self.patience])
        recent = history[-self.patience :]
        if self.mode == "min":
            return all(v > best_before - self.min_delta for v in recent)
        return all(v < best_before + self.min_delta for v in recent)


@dataclass(frozen=True)
class TrainResult:
    """What `train_and_evaluate` and `Estimator.train` return in the chief."""

    global_step: int
    metrics: dict[str, float]
    checkpoint: str | None
    first_loss: float | None
    final_loss: float | None
    elapsed_s: float
    """Wall time of the whole call in the chief, process start-up included."""
    training_s: float
    """From the PS being ready until the last worker finished."""
    start_step: int
    """The global step training started from (non-zero after a restore)."""
    worker_steps: dict[str, int]
    ps_stats: dict[str, Any]
    profile_dir: str | None = None
    """The merged capture of Estimator(profile_steps=...), if one was taken."""
    eval_history: list[dict[str, Any]] = field(default_factory=list)
    """Evaluations during training: {"global_step", "elapsed_s", "metrics"}."""
    stopped_early: bool = False
    preempted: bool = False
    """SIGTERM ended training early: `checkpoint` holds `global_step` and the next run resumes from it."""
    failed_checkpoint_saves: int = 0
    """Periodic checkpoints that could not be written (a full or read-only disk) while training went on."""

    @property
    def global_steps_per_s(self) -> float:
        steps = self.global_step - self.start_step
        return steps / self.training_s if self.training_s > 0 else 0.0


class Preempted(SystemExit):
    """Raised in the chief by `train_and_evaluate` when SIGTERM preempted the job, after the final checkpoint.

    A SystemExit with status 143, as SIGTERM itself gives: uncaught, it ends the program without a traceback and
    skips the code after the call, which expects a finished model; `except Exception` does not catch it.
    `result` says what was trained, with `preempted=True`."""

    def __init__(self, result: TrainResult) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.result = result
