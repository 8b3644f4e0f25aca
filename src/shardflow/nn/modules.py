"""`sf.nn` tables: embedding modules whose rows live only on the parameter servers. A model holds no weight for
them; in forward each asks the process's table backend (the worker's lookups, or a checkpoint's rows) for the
rows of the ids it is given, and backward leaves those rows' gradients for the worker to push."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from shardflow.nn import backend
from shardflow.ps.embeddings.spec import Initializer, RowOptimizer, TableSpec


class TableModule(torch.nn.Module):
    """What the three kinds share: the table's declaration, completed with its name (its path in the model) by
    `table_specs`."""

    def __init__(self, **fields: Any) -> None:
        super().__init__()
        self._fields = fields
        self.table_name: str | None = None
        spec = TableSpec(name="unnamed", **fields)  # checks the arguments now, where the user wrote them
        if spec.padding_idx is not None and spec.num_embeddings is not None:
            if not -spec.num_embeddings <= spec.padding_idx < spec.num_embeddings:
                raise ValueError(f"padding_idx must be within num_embeddings={spec.num_embeddings}")
            if spec.padding_idx < 0:
                self._fields["padding_idx"] = spec.padding_idx + spec.num_embeddings

    @property
    def embedding_dim(self) -> int:
        dim: int = self._fields["embedding_dim"]
        return dim

    def spec(self) -> TableSpec:
        if self.table_name is None:
            raise RuntimeError(
                f"this {type(self).__name__} has no name yet: it is named by its path in the model when the model "
                "is handed to shardflow (sf.nn.table_specs(model))"
            )
        return TableSpec(name=self.table_name, **self._fields)

    def _rows(self, ids: torch.Tensor) -> backend.Looked:
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(
                f"sf.nn table {self.table_name!r} looks up integer ids, got a {ids.dtype} tensor; cast it with .long()"
            )
        return backend.current(self).lookup(self, ids)

    def extra_repr(self) -> str:
        shown = {k: v for k, v in self._fields.items() if v is not None and k not in ("initializer", "optimizer")}
        return ", ".join(f"{k}={v}" for k, v in shown.items())


class Embedding(TableModule):
    """`torch.nn.Embedding` whose table lives only on the parameter servers, partitioned over them: no worker
    and not the chief ever allocates it. Each PS initialises its rows itself (`initializer`, seeded per row;
    N(0, 1) by default, as torch's). `optimizer`: the table's row optimizer (sf.nn.sgd/adagrad/rowwise_adagrad/
    lazy_adam); None applies the job's optimizer in its sparse form."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        *,
        initializer: Initializer | None = None,
        optimizer: RowOptimizer | None = None,
        partition: Literal["mod", "range"] = "mod",
    ) -> None:
        super().__init__(
            num_embeddings=num_embeddings,
            embedding_dim=embedding_dim,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            initializer=initializer or Initializer(),
            optimizer=optimizer,
            partition=partition,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        looked = self._rows(input)
        return F.embedding(looked.inverse, looked.rows)


class DynamicEmbedding(TableModule):
    """An embedding of any int64 ids (hashed features, no `num_embeddings`): each PS keeps a hash table of the
    rows it owns, made when an id is admitted (after `admit_after` sightings, or with `admit_probability` at each),
    removed when unseen for `expire_after_steps` global steps or, past `capacity_per_ps` rows, least frequently
    seen first. An id without a row reads its initial values and its gradient is dropped and counted. With
    `admit_after` > 1 each PS counts the sightings of up to `max_pending_per_ps` waiting ids (see TableSpec)."""

    def __init__(
        self,
        embedding_dim: int,
        *,
        admit_after: int = 1,
        admit_probability: float | None = None,
        expire_after_steps: int | None = None,
        capacity_per_ps: int | None = None,
        max_pending_per_ps: int | None = None,
        initializer: Initializer | None = None,
        optimizer: RowOptimizer | None = None,
    ) -> None:
        super().__init__(
            embedding_dim=embedding_dim,
            admit_after=admit_after,
            admit_probability=admit_probability,
            expire_after_steps=expire_after_steps,
            capacity_per_ps=capacity_per_ps,
            max_pending_per_ps=max_pending_per_ps,
            initializer=initializer or Initializer(),
            optimizer=optimizer,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        looked = self._rows(input)
        return F.embedding(looked.inverse, looked.rows)


class EmbeddingBag(TableModule):
    """`torch.nn.EmbeddingBag` (sum, mean or max of each bag; `per_sample_weights`; `padding_idx`) over a table
    that lives only on the parameter servers, as `sf.nn.Embedding`'s."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        mode: Literal["sum", "mean", "max"] = "mean",
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        *,
        initializer: Initializer | None = None,
        optimizer: RowOptimizer | None = None,
        partition: Literal["mod", "range"] = "mod",
    ) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(
            num_embeddings=num_embeddings,
            embedding_dim=embedding_dim,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            initializer=initializer or Initializer(),
            optimizer=optimizer,
            partition=partition,
        )
        self.mode, self.include_last_offset = mode, include_last_offset

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        looked = self._rows(input)
        padding = self._fields["padding_idx"]
        # The padding id's place among the batch's unique ids, if it occurs: torch leaves it out of every bag.
        padding_idx = None
        if padding is not None:
            where = (looked.unique == padding).nonzero()
            padding_idx = int(where[0, 0]) if where.numel() else None
        return F.embedding_bag(
            looked.inverse,
            looked.rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding_idx,
        )


def tables(model: torch.nn.Module) -> dict[str, TableModule]:
    """The model's `sf.nn` tables by their path in it, each named so (a table reached by two paths: the first)."""
    found: dict[str, TableModule] = {}
    for name, module in model.named_modules():
        if isinstance(module, TableModule):
            if not name:
                raise ValueError("an sf.nn table must sit inside a model (a torch.nn.Module holding it), not be one")
            module.table_name = name
            found[name] = module
    return found


def table_specs(model: torch.nn.Module) -> list[TableSpec]:
    """The declarations of the model's `sf.nn` tables, in the order of `tables`."""
    return [module.spec() for module in tables(model).values()]
