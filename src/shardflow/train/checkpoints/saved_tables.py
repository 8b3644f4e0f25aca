"""The rows of a model's `sf.nn` tables as a checkpoint (or the files the PS wrote for a snapshot) holds them, as
the table backend of an evaluation in one process: the chief's, the side-car evaluator's, `Estimator.evaluate`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from shardflow.nn import backend
from shardflow.nn.modules import TableModule, table_specs
from shardflow.ps.embeddings.chains import chain_order
from shardflow.ps.embeddings.files import FileRecord
from shardflow.ps.embeddings.init import initial_rows
from shardflow.ps.embeddings.spec import TableSpec
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.table_rows import gather_rows


class SavedTables:
    """Read-only lookups of saved rows; an id without a saved row reads its initial values, as on the PS."""

    def __init__(self, rows: dict[str, tuple[TableSpec, torch.Tensor, torch.Tensor]]) -> None:
        self.rows = rows
        """Per table: its spec, its saved ids (sorted) and their values."""

    @classmethod
    def of(cls, model: torch.nn.Module, state: ModelState, model_dir: str | Path) -> SavedTables:
        """The rows of `state`: a loaded checkpoint's (`state.tables`) or a snapshot's staged files."""
        rows = {}
        for spec in table_specs(model):
            files: list[tuple[Path, FileRecord | None]]
            if state.tables is not None:
                checkpoint = Path(state.tables.checkpoint)
                files = [(checkpoint / path, None) for path in state.tables.chains.get(spec.name, ())]
            else:
                staging = store.table_staging(model_dir)
                records = [r for r in state.table_files if r.table == spec.name]
                files = [(staging / record.path, record) for record in chain_order(records)]
            if files:
                ids, values = gather_rows(files, spec)
            else:  # nothing saved yet: every row as initialised
                ids, values = torch.empty(0, dtype=torch.int64), torch.empty((0, spec.embedding_dim))
            rows[spec.name] = (spec, ids, values)
        return cls(rows)

    def lookup(self, table: TableModule, ids: torch.Tensor) -> backend.Looked:
        spec, saved_ids, values = self.rows[table.table_name or ""]
        unique, inverse = torch.unique(ids.detach().reshape(-1).to("cpu", torch.int64), return_inverse=True)
        out = initial_rows(spec, unique)
        if saved_ids.numel():
            at = torch.searchsorted(saved_ids, unique).clamp_(max=saved_ids.numel() - 1)
            found = saved_ids[at] == unique
            out[found] = values[at[found]]
        if spec.padding_idx is not None:
            out[unique == spec.padding_idx] = 0
        return backend.Looked(out.to(ids.device), inverse.to(ids.device).view(ids.shape), unique)


@contextlib.contextmanager
def saved_tables(model: torch.nn.Module, state: ModelState, model_dir: str | Path) -> Iterator[None]:
    """Inside the block, `model`'s `sf.nn` tables read the rows of `state` (nothing for a model without any)."""
    if not table_specs(model):
        yield
        return
    with backend.installed(SavedTables.of(model, state, model_dir)):
        yield
