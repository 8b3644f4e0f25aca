"""The row optimizers of `RowOptimizer`: one coalesced update applied to the rows it touches, with the arithmetic of
torch's sparse path (SGD, Adagrad and SparseAdam on an `nn.Embedding(sparse=True)` gradient), and the slots each
keeps, tensors aligned with a table's storage rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardflow.ps.embeddings.spec import RowOptimizer


@dataclass(frozen=True, kw_only=True)
class SlotLayout:
    """One slot of every row: its shape per row ((dim,) or ()), dtype and the value a new row starts from."""

    row_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    initial: float = 0.0


def slot_layouts(optimizer: RowOptimizer, dim: int) -> dict[str, SlotLayout]:
    """The slots `optimizer` keeps for each row of a table of `dim` columns, by name."""
    if optimizer.name == "adagrad":
        return {"sum": SlotLayout(row_shape=(dim,), initial=optimizer.initial_accumulator_value)}
    if optimizer.name == "rowwise_adagrad":
        return {"sum": SlotLayout(row_shape=(), initial=optimizer.initial_accumulator_value)}
    if optimizer.name == "lazy_adam":
        moments = {"exp_avg": SlotLayout(row_shape=(dim,)), "exp_avg_sq": SlotLayout(row_shape=(dim,))}
        return moments | ({"step": SlotLayout(row_shape=(), dtype=torch.int64)} if optimizer.per_row_steps else {})
    return {}


def new_slots(layouts: dict[str, SlotLayout], num_rows: int) -> dict[str, torch.Tensor]:
    """The slots of `num_rows` new rows."""
    return {
        name: torch.full((num_rows, *layout.row_shape), layout.initial, dtype=layout.dtype)
        for name, layout in layouts.items()
    }


def apply_update(
    optimizer: RowOptimizer,
    values: torch.Tensor,
    slots: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grads: torch.Tensor,
    *,
    step: int,
    lr: float | None = None,
) -> None:
    """Updates `values` and `slots` at `rows` (distinct storage rows) by `grads` (one summed row each). `step` is
    the table's count of updates, this one included, as torch's optimizers count it; `lr` overrides the optimizer's
    (a schedule's value for this step)."""
    lr = optimizer.lr if lr is None else lr
    if optimizer.name == "sgd":
        _add_rows(values, rows, grads, alpha=-lr)
    elif optimizer.name == "adagrad":
        _adagrad(values, slots["sum"], rows, grads, _decayed(optimizer, lr, step), optimizer.eps)
    elif optimizer.name == "rowwise_adagrad":
        _rowwise_adagrad(values, slots["sum"], rows, grads, _decayed(optimizer, lr, step), optimizer.eps)
    else:
        _lazy_adam(optimizer, values, slots, rows, grads, step=step, lr=lr)


def _add_rows(target: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor, alpha: float = 1.0) -> None:
    """target[rows] += alpha * delta for distinct `rows`: gathered, added and written back, the same sums as
    `index_add_`, which adds one row at a time on the CPU (measured: 4.7x slower for 2,000 rows of 16)."""
    target.index_copy_(0, rows, target.index_select(0, rows).add_(delta, alpha=alpha))


def _decayed(optimizer: RowOptimizer, lr: float, step: int) -> float:
    """Adagrad's learning rate at `step`: lr / (1 + (step - 1) lr_decay)."""
    return lr / (1 + (step - 1) * optimizer.lr_decay)


def _adagrad(
    values: torch.Tensor, state_sum: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, lr: float, eps: float
) -> None:
    summed = state_sum.index_select(0, rows).add_(grads * grads)
    state_sum.index_copy_(0, rows, summed)
    _add_rows(values, rows, grads / summed.sqrt_().add_(eps), alpha=-lr)


def _rowwise_adagrad(
    values: torch.Tensor, state_sum: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, lr: float, eps: float
) -> None:
    """One accumulator per row, the mean over the row of the squared gradient (FBGEMM's row-wise Adagrad)."""
    summed = state_sum.index_select(0, rows).add_((grads * grads).mean(dim=1))
    state_sum.index_copy_(0, rows, summed)
    _add_rows(values, rows, grads / summed.sqrt_().add_(eps).unsqueeze(1), alpha=-lr)


def _lazy_adam(
    optimizer: RowOptimizer,
    values: torch.Tensor,
    slots: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grads: torch.Tensor,
    *,
    step: int,
    lr: float,
) -> None:
    """SparseAdam's arithmetic, operation for operation: the moments move only on the rows in the gradient."""
    beta1, beta2 = optimizer.beta1, optimizer.beta2
    exp_avg, exp_avg_sq = slots["exp_avg"], slots["exp_avg_sq"]
    old_exp_avg = exp_avg.index_select(0, rows)
    exp_avg_update = (grads - old_exp_avg).mul_(1 - beta1)
    _add_rows(exp_avg, rows, exp_avg_update)
    old_exp_avg_sq = exp_avg_sq.index_select(0, rows)
    exp_avg_sq_update = (grads * grads).sub_(old_exp_avg_sq).mul_(1 - beta2)
    _add_rows(exp_avg_sq, rows, exp_avg_sq_update)
    numer = exp_avg_update.add_(old_exp_avg)
    denom = exp_avg_sq_update.add_(old_exp_avg_sq).sqrt_().add_(optimizer.eps)
    if "step" in slots:
        steps = slots["step"].index_select(0, rows).add_(1)
        slots["step"].index_copy_(0, rows, steps)
        exponent = steps.to(torch.float64)
        step_size = lr * (1 - beta2**exponent).sqrt_() / (1 - beta1**exponent)
        _add_rows(values, rows, numer.div_(denom).mul_(-step_size.to(torch.float32).unsqueeze(1)))
    else:
        table_step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        _add_rows(values, rows, numer.div_(denom).mul_(-table_step_size))
