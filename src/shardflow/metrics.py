"""`sf.metrics`: streaming evaluation metrics, exact over the whole evaluation set (docs/training.md).

EvalSpec(metrics={"auc": (sf.metrics.AUC(), lambda model, batch: (model(batch[0]), batch[1]))})

Each keeps sums, counts or every score, never a mean of batch means, and `merge()` adds another's state to its own,
so that parts of one evaluation computed apart combine into the metric of the whole.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["AUC", "Mean", "Metric"]


@runtime_checkable
class Metric(Protocol):
    """What an evaluation needs of a metric: torchmetrics' `Metric` has it, and so do `Mean` and `AUC`."""

    def update(self, *args: Any, **kwargs: Any) -> Any:
        """Add one batch."""

    def compute(self) -> Any:
        """The metric of every batch added since `reset`: a number or a one-element tensor."""

    def reset(self) -> None:
        """Forget every batch added."""


class Mean:
    """The weighted mean of every value added: sum(value * weight) / sum(weight), over all batches.

    `update(values)` counts each element of `values` once; `update(batch_mean, weight=batch_size)` counts a batch's
    mean as that many values (torchmetrics' `MeanMetric` means the same)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.total_weight = 0.0

    def update(self, values: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        values = _float64(values)
        weights = _float64(weight).to(values.device).expand_as(values)
        self.total += float((values * weights).sum())
        self.total_weight += float(weights.sum())

    def compute(self) -> float:
        """NaN before any value is added."""
        return self.total / self.total_weight if self.total_weight else math.nan

    def reset(self) -> None:
        self.total = 0.0
        self.total_weight = 0.0

    def merge(self, other: Mean) -> None:
        self.total += other.total
        self.total_weight += other.total_weight


class AUC:
    """Area under the ROC curve of binary labels, exact: every score is kept (9 bytes an example) and ranked once in
    `compute()`, ties sharing their mean rank, as scikit-learn's `roc_auc_score` counts them.

    `update(scores, labels)`: one score per label, any shape; a score is anything that orders the examples (a
    probability or a logit), a label is 0 or 1 (ints, floats or bools)."""

    def __init__(self) -> None:
        self.scores: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def update(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        scores = torch.as_tensor(scores).detach().reshape(-1).to("cpu", torch.float64)
        labels = torch.as_tensor(labels).detach().reshape(-1).to("cpu")
        if scores.numel() != labels.numel():
            raise ValueError(
                f"AUC.update got {scores.numel()} scores and {labels.numel()} labels: give one score per label"
            )
        if scores.isnan().any():
            raise ValueError("AUC.update got a NaN score: the model's output is not finite")
        binary = (labels == 0) | (labels == 1)
        if not binary.all():
            raise ValueError(f"AUC labels must be 0 or 1, got {labels[~binary][0].item()}")
        self.scores.append(scores)
        self.labels.append(labels.bool())

    def compute(self) -> float:
        """NaN while the labels added are all of one class (no pair of a positive and a negative to rank)."""
        scores = torch.cat(self.scores) if self.scores else torch.empty(0, dtype=torch.float64)
        labels = torch.cat(self.labels) if self.labels else torch.empty(0, dtype=torch.bool)
        num_positive = int(labels.sum())
        num_negative = labels.numel() - num_positive
        if num_positive == 0 or num_negative == 0:
            return math.nan
        # Mann-Whitney: the positives' rank sum, less its least possible value, counts the pairs ranked right.
        rank_sum = float(_mean_ranks(scores)[labels].sum())
        return (rank_sum - num_positive * (num_positive + 1) / 2) / (num_positive * num_negative)

    def reset(self) -> None:
        self.scores = []
        self.labels = []

    def merge(self, other: AUC) -> None:
        self.scores += other.scores
        self.labels += other.labels


def _float64(value: torch.Tensor | float) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.as_tensor(value, dtype=torch.float64)  # a Python float as it is, not rounded to float32 first


def _mean_ranks(values: torch.Tensor) -> torch.Tensor:
    """The 1-based rank of each value in ascending order; equal values share the mean of their ranks."""
    ordered, order = torch.sort(values)
    _, counts = torch.unique_consecutive(ordered, return_counts=True)
    last = counts.cumsum(0)
    mean_rank = (2 * last - counts + 1).to(torch.float64) / 2
    ranks = torch.empty_like(values, dtype=torch.float64)
    ranks[order] = mean_rank.repeat_interleave(counts)
    return ranks
