"""What a `sf.nn` table is, declared once for the worker that looks it up, the PS that holds it and the
checkpoints that keep it: its shape, initializer, optimizer, admission, expiry and capacity, and which PS owns
each id. Sent to every PS in the chief's `Init`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import torch

PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=2**62)]
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0.0, le=1e300)]


class Initializer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a row's first values are drawn: from a counter-based generator keyed by (seed, table, id), so any PS
    makes the same row for the same id whenever it is made, and no process builds the whole table."""

    kind: Literal["normal", "uniform", "zeros", "constant"] = "normal"
    mean: float = 0.0
    std: NonNegative = 1.0
    """normal: as torch.nn.Embedding's default N(0, 1)."""
    low: float = -0.05
    high: float = 0.05
    value: float = 0.0
    """constant: every element."""
    seed: int = 0


class RowOptimizer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The optimizer a PS applies to a table's rows, one row at a time, as torch's sparse path computes it in one
    process: sgd (SGD without momentum), adagrad (torch.optim.Adagrad on a sparse gradient), rowwise_adagrad
    (one accumulator per row: the mean of the squared gradient over the row, as FBGEMM's), lazy_adam
    (torch.optim.SparseAdam: moments of the rows in the gradient only)."""

    name: Literal["sgd", "adagrad", "rowwise_adagrad", "lazy_adam"]
    lr: NonNegative
    eps: NonNegative = 1e-10
    """adagrad, rowwise_adagrad: 1e-10 as torch's Adagrad; lazy_adam: 1e-8 as SparseAdam."""
    initial_accumulator_value: NonNegative = 0.0
    lr_decay: NonNegative = 0.0
    beta1: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.9
    beta2: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.999
    per_row_steps: bool = False
    """lazy_adam: count steps per row (a row's bias correction starts when it is first updated) rather than per
    table as SparseAdam does; what dynamic tables want, where rows appear late."""


class TableSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One `sf.nn` table. `num_embeddings` None: a dynamic table (any int64 id, rows made on admission)."""

    name: str
    """The module's path in the model, e.g. "items" or "towers.0.users": the table's name everywhere."""
    embedding_dim: PositiveInt
    num_embeddings: PositiveInt | None = None
    dtype: Literal["float32"] = "float32"
    initializer: Initializer = Initializer()
    optimizer: RowOptimizer | None = None
    """None: the job's optimizer, in its sparse form (SGD -> sgd, Adagrad -> adagrad, Adam -> lazy_adam)."""
    partition: Literal["mod", "range"] = "mod"
    """Fixed tables: which PS owns id i: i mod num_ps, or contiguous ranges. Dynamic tables always hash."""
    padding_idx: int | None = None
    """That id reads zeros and its gradient is never applied (as torch.nn.Embedding's)."""
    max_norm: float | None = None
    """Rows read with a larger norm are renormalised on the PS (as torch.nn.Embedding's, at lookup)."""
    norm_type: float = 2.0
    admit_after: PositiveInt = 1
    """Dynamic: a row is made once its id was seen this many times (occurrences in applied batches)."""
    admit_probability: Fraction | None = None
    """Dynamic: instead of counting, admit an id at a sighting with this probability (no counter kept)."""
    expire_after_steps: PositiveInt | None = None
    """Dynamic: a row unseen for this many global steps is removed."""
    capacity_per_ps: PositiveInt | None = None
    """Dynamic: at most this many rows per PS; beyond, the least frequently seen rows are evicted."""
    max_pending_per_ps: PositiveInt | None = None
    """Dynamic with admit_after > 1: at most this many ids counted while they wait for admission, per PS (about
    100 bytes each; None: capacity_per_ps, else 1,048,576); beyond, the least recently seen are forgotten and their
    count starts again."""

    @property
    def dynamic(self) -> bool:
        return self.num_embeddings is None

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: Fibonacci hashing's odd multiplier
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 (splitmix64's)


def mix(ids: torch.Tensor) -> torch.Tensor:
    """A well-spread int64 of each int64 id (splitmix64's finaliser; int64 arithmetic wraps), never negative."""
    x = ids.to(torch.int64) * _MIX
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x * _MIX2
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    return x & ((1 << 62) - 1)


def owners(spec: TableSpec, ids: torch.Tensor, num_ps: int) -> torch.Tensor:
    """The PS index that owns each id (int64 tensor in, int64 tensor out)."""
    if num_ps == 1:
        return torch.zeros_like(ids, dtype=torch.int64)
    if spec.dynamic:
        return mix(ids) % num_ps
    if spec.partition == "range":
        assert spec.num_embeddings is not None
        return ids // rows_per_range(spec.num_embeddings, num_ps)
    return ids % num_ps


def rows_per_range(num_embeddings: int, num_ps: int) -> int:
    return -(-num_embeddings // num_ps)


def num_local_rows(spec: TableSpec, ps_index: int, num_ps: int) -> int:
    """Fixed tables: how many rows PS `ps_index` of `num_ps` owns."""
    n = spec.num_embeddings
    assert n is not None, "dynamic tables have no fixed row count"
    if spec.partition == "range":
        block = rows_per_range(n, num_ps)
        return max(0, min(n, (ps_index + 1) * block) - ps_index * block)
    return (n - ps_index + num_ps - 1) // num_ps


def local_rows(spec: TableSpec, ids: torch.Tensor, ps_index: int, num_ps: int) -> torch.Tensor:
    """Fixed tables: the row number, on its owner `ps_index`, of each id it owns."""
    if spec.partition == "range":
        assert spec.num_embeddings is not None
        return ids - ps_index * rows_per_range(spec.num_embeddings, num_ps)
    return ids // num_ps


def global_ids(spec: TableSpec, rows: torch.Tensor, ps_index: int, num_ps: int) -> torch.Tensor:
    """Fixed tables: the inverse of `local_rows`."""
    if spec.partition == "range":
        assert spec.num_embeddings is not None
        return rows + ps_index * rows_per_range(spec.num_embeddings, num_ps)
    return rows * num_ps + ps_index
