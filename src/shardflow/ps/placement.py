"""Where each variable lives: dim-0 partitioning of large tensors and greedy-by-size placement on the PS.

Dense pieces are packed into one flat buffer per dtype on their PS; row-sparse pieces (embedding tables) stay
tensors of their own there, read and updated a few rows at a time."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class Partitioner:
    """How variables are cut along dim 0 before placement, like TF's min-size and fixed-shard partitioners."""

    min_slice_bytes: int = 256 << 10
    """A tensor is cut into slices of at least this many bytes (TF's min_slice_size)."""
    max_partitions: int | None = None
    """At most this many slices per tensor; None means one per PS."""
    fixed_shards: int | None = None
    """If set, every tensor with enough rows is cut into exactly this many slices (TF's fixed_size_partitioner)."""

    def __post_init__(self) -> None:
        if self.min_slice_bytes <= 0:
            raise ValueError(f"Partitioner.min_slice_bytes must be positive, got {self.min_slice_bytes}")
        if self.max_partitions is not None and self.max_partitions < 1:
            raise ValueError(f"Partitioner.max_partitions must be >= 1, got {self.max_partitions}")
        if self.fixed_shards is not None and self.fixed_shards < 1:
            raise ValueError(f"Partitioner.fixed_shards must be >= 1, got {self.fixed_shards}")

    def num_slices(self, shape: Sequence[int], itemsize: int, num_ps: int) -> int:
        rows = shape[0] if shape else 1
        if not shape or rows < 2:
            return 1
        if self.fixed_shards is not None:
            return min(self.fixed_shards, rows)
        nbytes = math.prod(shape) * itemsize
        limit = self.max_partitions if self.max_partitions is not None else num_ps
        return max(1, min(limit, rows, nbytes // self.min_slice_bytes))


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Rows [row_start, row_end) of variable `name`, stored on PS `ps` at `offset` of its `dtype` buffer, or,
    if `sparse`, as a table of its own there (offset 0)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    row_start: int
    row_end: int
    ps: int
    offset: int
    numel: int
    sparse: bool = False

    @property
    def piece_shape(self) -> tuple[int, ...]:
        if not self.shape:
            return ()
        return (self.row_end - self.row_start, *self.shape[1:])

    @property
    def partitioned(self) -> bool:
        return bool(self.shape) and (self.row_end - self.row_start) != self.shape[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "rows": [self.row_start, self.row_end],
            "ps": self.ps,
            "offset": self.offset,
            "numel": self.numel,
            "sparse": self.sparse,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Piece:
        return cls(
            name=d["name"],
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            row_start=d["rows"][0],
            row_end=d["rows"][1],
            ps=d["ps"],
            offset=d["offset"],
            numel=d["numel"],
            sparse=bool(d.get("sparse", False)),
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Placement:
    """The pieces of every variable; each PS holds one flat buffer per dtype, its dense pieces packed in order,
    and its sparse pieces as tables in placement order."""

    num_ps: int
    pieces: tuple[Piece, ...]
    names: tuple[str, ...] = field(default=())

    def on_ps(self, ps: int) -> list[Piece]:
        return [p for p in self.pieces if p.ps == ps]

    def tables(self, ps: int) -> list[Piece]:
        """The sparse pieces on `ps`, in the order the PS keeps them."""
        return [p for p in self.pieces if p.ps == ps and p.sparse]

    def buffer_sizes(self, ps: int) -> dict[str, int]:
        """Element count of each dtype buffer on `ps`, in a stable dtype order."""
        sizes: dict[str, int] = {}
        for p in self.on_ps(ps):
            if not p.sparse:
                sizes[p.dtype] = max(sizes.get(p.dtype, 0), p.offset + p.numel)
        return dict(sorted(sizes.items()))

    def bytes_per_ps(self) -> list[int]:
        totals = [0] * self.num_ps
        for p in self.pieces:
            totals[p.ps] += p.numel * torch.empty((), dtype=getattr(torch, p.dtype)).element_size()
        return totals

    def to_json(self) -> dict[str, Any]:
        return {
            "num_ps": self.num_ps,
            "names": list(self.names),
            "pieces": [p.to_json() for p in self.pieces],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Placement:
        return cls(d["num_ps"], tuple(Piece.from_json(p) for p in d["pieces"]), tuple(d["names"]))


def place(
    variables: Iterable[tuple[str, torch.Tensor]],
    num_ps: int,
    partitioner: Partitioner | None = None,
    sparse: Collection[str] = (),
) -> Placement:
    """Cut variables along dim 0, then put the largest piece first onto the PS with the fewest bytes. The
    variables named in `sparse` are cut and balanced the same way but kept out of the dtype buffers."""
    if num_ps < 1:
        raise ValueError(f"num_ps must be >= 1 to place variables, got {num_ps}")
    partitioner = partitioner or Partitioner()
    slices: list[tuple[int, str, tuple[int, ...], str, int, int, int]] = []
    names: list[str] = []
    for name, tensor in variables:
        names.append(name)
        shape = tuple(tensor.shape)
        n = partitioner.num_slices(shape, tensor.element_size(), num_ps)
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:]) if shape else 1
        bounds = [rows * i // n for i in range(n + 1)]
        for start, end in itertools.pairwise(bounds):
            numel = (end - start) * row_numel
            slices.append(
                (
                    numel * tensor.element_size(),
                    name,
                    shape,
                    dtype_name(tensor.dtype),
                    start,
                    end,
                    numel,
                )
            )
    # Largest first; ties keep model order so the placement is deterministic on every role.
    order = sorted(range(len(slices)), key=lambda i: (-slices[i][0], i))
    load = [0] * num_ps
    offsets: list[dict[str, int]] = [{} for _ in range(num_ps)]
    pieces: list[Piece | None] = [None] * len(slices)
    for i in order:
        nbytes, name, shape, dtype, start, end, numel = slices[i]
        ps = min(range(num_ps), key=lambda k: (load[k], k))
        load[ps] += nbytes
        offset = 0
        if name not in sparse:
            offset = offsets[ps].get(dtype, 0)
            offsets[ps][dtype] = offset + numel
        pieces[i] = Piece(
            name=name,
            shape=shape,
            dtype=dtype,
            row_start=start,
            row_end=end,
            ps=ps,
            offset=offset,
            numel=numel,
            sparse=name in sparse,
        )
    return Placement(num_ps, tuple(p for p in pieces if p is not None), tuple(names))
