"""The job as every role receives it: one frozen config built from the Estimator and the specs, and what a role
does with the model it describes (build it, evaluate it)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic

import torch
from typing_extensions import TypeIs, TypeVar

from shardflow.ps.optimizers import OptimizerSpec
from shardflow.train.evaluation import evaluate_model
from shardflow.train.specs import EvalSpec, TrainSpec
from shardflow.train.strategy import AllReduceStrategy, HybridStrategy, ParameterServerStrategy, Strategy

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
ModelFn = Callable[[], torch.nn.Module] | torch.nn.Module
"""A function building the model, or the model itself."""
StrategyT = TypeVar("StrategyT", bound=Strategy, default=ParameterServerStrategy, covariant=True)


class UserCodeError(RuntimeError):
    """The user's code or data failed in a role (loss_fn, the model, input_fn, a batch): it would fail the same way
    again, so the role is not restarted (cluster/launcher.py USER_ERROR_EXIT_CODE) and the job fails naming it."""


@contextlib.contextmanager
def user_code(what: str, name: str, step: int) -> Iterator[None]:
    """An error raised by the user's code or data inside the block (not shardflow's own: a lost PS, a restore) is a
    UserCodeError naming the role, the step and `what` failed: the role is not restarted for it."""
    try:
        yield
    except Exception as error:
        if type(error).__module__.startswith("shardflow."):
            raise
        raise UserCodeError(f"{name}: {what} raised at global step {step}: {type(error).__name__}: {error}") from error


def check_loss(loss: object, name: str) -> None:
    """UserCodeError, naming role `name` and the fix, unless loss_fn returned a scalar tensor."""
    if not isinstance(loss, torch.Tensor):
        raise UserCodeError(f"{name}: loss_fn returned a {type(loss).__name__}; it must return a scalar tensor")
    if loss.numel() != 1:
        raise UserCodeError(
            f"{name}: loss_fn returned a tensor of shape {tuple(loss.shape)}; it must return a scalar: reduce it, "
            "e.g. loss.mean(), or use the loss's reduction='mean' (not 'none')"
        )


class RoleFailedError(RuntimeError):
    """A process of the job failed or stopped answering; the message names its role and why."""


@dataclass(frozen=True, kw_only=True)
class JobConfig(Generic[StrategyT]):
    """What the chief, the workers, the PS and the evaluator are given; built once per job by `train_and_evaluate`.
    A bare `JobConfig` is a parameter-server job's."""

    model_fn: ModelFn
    """Builds the model, the same in every process (see `build_model`)."""
    loss_fn: LossFn
    """(model, batch) -> scalar loss tensor."""
    optimizer: OptimizerSpec
    """The optimizer the PS apply."""
    strategy: StrategyT
    """How training is distributed."""
    model_dir: Path
    """Checkpoints, logs, summaries and captures."""
    seed: int = 0
    """Seeds the model's initial values."""
    train_spec: TrainSpec
    """The training input and how long to train."""
    eval_spec: EvalSpec | None = None
    """Evaluation during training; None trains only."""
    profile_steps: tuple[int, int] | None = None
    """Global steps [first, last) captured on every role."""
    profile_ops: bool = False
    """Also record torch ops, shapes, memory and Python source in the capture."""
    save_checkpoints_steps: int | None = None
    """Checkpoint at every multiple of this global step."""
    save_checkpoints_secs: float | None = 600.0
    """Checkpoint at most this often when save_checkpoints_steps is None."""
    keep_checkpoint_max: int | None = 5
    """Checkpoints kept; None keeps all."""
    full_checkpoint_every: int = 10
    """Every this many checkpoints the PS write every row of the `sf.nn` tables; in between, the rows changed."""
    save_summary_steps: int = 100
    """TensorBoard training scalars at every multiple of this global step, and at the last."""

    def build_model(self) -> torch.nn.Module:
        return build_model(self.model_fn, self.seed)

    def evaluate(self, model: torch.nn.Module, eval_spec: EvalSpec) -> dict[str, float]:
        return evaluate_model(model, self.loss_fn, eval_spec)


def is_all_reduce(job: JobConfig[Strategy]) -> TypeIs[JobConfig[AllReduceStrategy]]:
    """Whether `job` trains with `AllReduceStrategy` or `HybridStrategy` (else with the parameter servers alone)."""
    return isinstance(job.strategy, AllReduceStrategy)


def is_hybrid(job: JobConfig[Strategy]) -> TypeIs[JobConfig[HybridStrategy]]:
    """Whether `job` trains with `HybridStrategy` (an all-reduce job whose `sf.nn` tables live on PS)."""
    return isinstance(job.strategy, HybridStrategy)


def is_parameter_server(job: JobConfig[Strategy]) -> TypeIs[JobConfig[ParameterServerStrategy]]:
    """Whether `job` trains with `ParameterServerStrategy`."""
    return isinstance(job.strategy, ParameterServerStrategy)


def build_model(model_fn: ModelFn, seed: int) -> torch.nn.Module:
    """The model as model_fn builds it, with the same initial values in every process; a module given in its place
    is copied, so each role (and each call) gets a model of its own with the module's values."""
    if isinstance(model_fn, torch.nn.Module):
        return copy.deepcopy(model_fn)
    torch.manual_seed(seed)
    model = model_fn()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"Estimator.model_fn must return a torch.nn.Module, got {type(model).__name__}")
    return model
