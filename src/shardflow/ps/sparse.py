"""Row-sparse variables: the weights of `nn.Embedding` and `nn.EmbeddingBag` with `sparse=True`. Each of their
pieces is a table of its own on its PS; a worker fetches only the rows its batch looks up and pushes only the
gradients of those rows, as (row numbers, row values) frames."""

from __future__ import annotations

import torch

RowGrad = tuple[torch.Tensor, torch.Tensor]
"""A row-sparse gradient of one table: int64 row numbers (local to the table) and one value row for each."""
EmbeddingGrad = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One push's gradient of one `sf.nn` table on one PS: the batch's unique ids it owns (int64), how often each
occurred (int64), and each one's gradient row."""


def sparse_variables(model: torch.nn.Module) -> list[str]:
    """The names (as in `named_parameters`) of the weights of the model's sparse embeddings."""
    names = {id(param): name for name, param in model.named_parameters()}
    found: list[str] = []
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            name = names.get(id(module.weight))
            if name is not None and name not in found:
                found.append(name)
    return found


def lookup_modules(model: torch.nn.Module, names: list[str]) -> dict[str, list[torch.nn.Module]]:
    """The sparse embedding modules that look up each named weight (a shared weight may have several)."""
    named = dict(model.named_parameters())
    by_weight = {id(named[name]): name for name in names}
    found: dict[str, list[torch.nn.Module]] = {name: [] for name in names}
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and id(module.weight) in by_weight:
            if not module.sparse:
                raise ValueError(
                    f"{by_weight[id(module.weight)]!r} is placed as a row-sparse variable, but a "
                    f"{type(module).__name__} with sparse=False looks it up; every module using it must be sparse"
                )
            found[by_weight[id(module.weight)]].append(module)
    missing = [name for name, modules in found.items() if not modules]
    if missing:
        raise ValueError(f"the placement names row-sparse variables that no sparse embedding looks up: {missing}")
    return found


def coalesced(name: str, weight: torch.Tensor) -> RowGrad:
    """A sparse embedding's gradient as sorted, unique row numbers and their summed values."""
    grad = weight.grad
    if grad is None:
        return torch.empty(0, dtype=torch.int64), weight.new_empty((0, *weight.shape[1:]))
    if not grad.is_sparse:
        raise ValueError(
            f"{name!r} is row-sparse (a sparse embedding) but got a dense gradient: is the weight also used outside "
            "the embedding lookup? Then make the embedding dense (sparse=False)"
        )
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


def rows_between(rows: torch.Tensor, starts: list[int], num_rows: int) -> list[tuple[int, int]]:
    """For sorted `rows`, the [begin, end) positions of those in each table piece starting at `starts` (sorted)."""
    cuts = torch.searchsorted(rows, torch.tensor([*starts, num_rows], dtype=rows.dtype)).tolist()
    return [(cuts[i], cuts[i + 1]) for i in range(len(starts))]


def check_rows(rows: torch.Tensor, table: torch.Tensor, what: str) -> None:
    """Row numbers from the network must index `table`: out of range they would read or write outside it."""
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(
            f"{what}: row numbers must be a 1-D int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}"
        )
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]):
        raise ValueError(
            f"{what}: row numbers from {int(rows.min())} to {int(rows.max())} do not fit a table of "
            f"{table.shape[0]} rows"
        )


def check_row_grad(rows: torch.Tensor, values: torch.Tensor, table: torch.Tensor, what: str) -> None:
    """A pushed row-sparse gradient must fit its table, row numbers and values alike."""
    check_rows(rows, table, what)
    if values.dtype != table.dtype or tuple(values.shape) != (rows.numel(), *table.shape[1:]):
        raise ValueError(
            f"{what}: {rows.numel()} rows of a table shaped {tuple(table.shape)} came with values of "
            f"{values.dtype} shaped {tuple(values.shape)}"
        )


def row_gradient(table: torch.Tensor, grads: list[RowGrad], count: int) -> torch.Tensor:
    """The sparse gradient of `table` from checked pushes: every pushed row summed (a row pushed twice counts
    twice), divided by `count` as the dense gradients are, coalesced."""
    rows = torch.cat([r for r, _ in grads]) if len(grads) > 1 else grads[0][0]
    values = torch.cat([v for _, v in grads]) if len(grads) > 1 else grads[0][1]
    # The rows were checked on arrival; torch's own check would only repeat that.
    grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, table.shape, check_invariants=False).coalesce()
    if count == 1:
        return grad
    values = grad.values() / count
    return torch.sparse_coo_tensor(grad.indices(), values, table.shape, is_coalesced=True, check_invariants=False)
