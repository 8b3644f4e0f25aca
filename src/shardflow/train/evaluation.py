"""Evaluation over the whole evaluation input: every metric streams over the batches and is computed once at the end,
so a metric that is not a mean of per-batch values (AUC) is exact, and a mean weighs every example alike."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable
from typing import Any

import torch

from shardflow.data.torch_edge import to_torch
from shardflow.metrics import Mean, Metric
from shardflow.train.specs import EvalSpec, InputContext, MetricFn, MetricSpec

_Streaming = tuple[Metric, Callable[[torch.nn.Module, Any], Any]]
"""A metric and the function that turns (model, batch) into the arguments of its update()."""


def evaluate_model(model: torch.nn.Module, loss_fn: MetricFn, eval_spec: EvalSpec) -> dict[str, float]:
    """The loss and each metric of `model` over the whole evaluation input (or its first `steps` batches), in this
    process. The loss and plain metric functions are means over the examples (see `_mean_of`); a pair
    (metric, fn) is `metric.compute()` after one `update` per batch."""
    metrics = {
        "loss": _mean_of("the loss_fn", loss_fn),
        **{name: _streaming(name, spec) for name, spec in eval_spec.metrics.items()},
    }
    for metric, _ in metrics.values():
        metric.reset()  # a metric object of the EvalSpec serves every evaluation of the job
    num_batches = 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in itertools.islice(eval_spec.input_fn(InputContext(1, 0)), eval_spec.steps):
                batch = to_torch(batch)
                for metric, update_arguments in metrics.values():
                    arguments = update_arguments(model, batch)
                    if isinstance(arguments, tuple):
                        metric.update(*arguments)
                    else:
                        metric.update(arguments)
                num_batches += 1
    finally:
        model.train()
    if num_batches == 0:
        raise ValueError(
            "EvalSpec.input_fn yielded no batch, so there is nothing to evaluate: check the evaluation files "
            "(a glob that matches none, an empty file) or the input_fn"
        )
    return {name: _number(name, metric.compute()) for name, (metric, _) in metrics.items()}


def _streaming(name: str, spec: MetricSpec) -> _Streaming:
    if isinstance(spec, tuple):
        return spec
    return _mean_of(f"EvalSpec.metrics[{name!r}]", spec)


def _mean_of(what: str, fn: MetricFn) -> _Streaming:
    """`fn(model, batch)` as a mean over the examples. A tensor of one or more dimensions holds per-example values,
    each counted once; a number or a 0-d tensor is the batch's mean, counted once per example of the batch."""

    def values_and_weight(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, float]:
        value = fn(model, batch)
        try:
            values = value if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{what} must return a number or a tensor, got {type(value).__name__}") from error
        return (values, 1.0) if values.dim() else (values, float(_num_examples(what, batch)))

    return Mean(), values_and_weight


def _num_examples(what: str, batch: Any) -> int:
    """The leading dimension of the batch's first tensor: dict values, tuple and list items in order, depth first."""
    tensor = _first_tensor(batch)
    if tensor is None:
        raise ValueError(
            f"{what} returned one number for a batch that holds no tensor, so the batch's examples cannot be "
            "counted to weigh it: return a tensor of per-example values instead"
        )
    return tensor.shape[0] if tensor.dim() else 1


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, tuple | list) else ()
    for item in items:
        tensor = _first_tensor(item)
        if tensor is not None:
            return tensor
    return None


def _number(name: str, value: Any) -> float:
    """`compute()`'s value as the float that TrainResult.metrics, the eval history and TensorBoard hold."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(
        f"EvalSpec.metrics[{name!r}]: compute() returned {got}, and an evaluation records numbers: give a metric "
        "whose compute() returns one number (a torchmetrics metric averaged over classes, not one per class)"
    )
