"""Where an `sf.nn` table's rows come from in this process: the worker's lookups to the PS while it trains, a
checkpoint's rows for the evaluator, or in-process tables for one-process use. One backend at a time."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from shardflow.nn.modules import TableModule


class Looked(NamedTuple):
    """The rows a lookup found: `rows[inverse]` are the rows of the ids looked up, in their shape."""

    rows: torch.Tensor
    """[unique ids, dim]: a leaf that gathers the rows' gradient when training."""
    inverse: torch.Tensor
    """int64, shaped as the ids: each id's row in `rows`."""
    unique: torch.Tensor
    """int64: the id of each row of `rows`."""


class TableBackend(Protocol):
    def lookup(self, table: TableModule, ids: torch.Tensor) -> Looked: ...


_current: TableBackend | None = None


def current(table: TableModule) -> TableBackend:
    """The backend in use; an error naming `table` where there is none."""
    if _current is None:
        raise RuntimeError(
            f"sf.nn table {table.table_name!r} lives on the parameter servers: in a shardflow job the worker looks its "
            "rows up; to run the model in one process, wrap the calls in `with sf.nn.local_tables(model, "
            "optimizer):`; Estimator.evaluate reads a checkpoint's rows"
        )
    return _current


@contextlib.contextmanager
def installed(backend: TableBackend) -> Iterator[TableBackend]:
    """Serve every `sf.nn` table's lookups from `backend` inside the block."""
    global _current
    before, _current = _current, backend
    try:
        yield backend
    finally:
        _current = before
