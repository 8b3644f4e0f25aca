"""Synthetic table states for the tests of the table files: a scenario of saves by several PS, the rows it leaves,
and `DictTable`, a stand-in for a PS's table that loads states as the PS's does (its owned rows, removed ids gone)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from shardflow.ps.embeddings.chains import chain_order, link_into
from shardflow.ps.embeddings.files import FileRecord, write_shard
from shardflow.ps.embeddings.spec import RowOptimizer, TableSpec, owners
from shardflow.train.checkpoints import store

DYNAMIC = TableSpec(name="towers.0.users", embedding_dim=3, optimizer=RowOptimizer(name="adagrad", lr=0.1))
FIXED = TableSpec(name="items", embedding_dim=4, num_embeddings=1000, partition="range")

# (step, kind, ids written (changed, or all of them in a full), ids removed since the step before)
SCENARIO = [
    (10, "full", [5, 17, 42, 999, 77, 500, 640, 8], []),
    (20, "increment", [17, 99, 640], [42, 8]),  # 99 admitted, 42 and 8 removed
    (30, "increment", [42, 5], [99, 999]),  # 42 admitted again, 99 and 999 removed
]


def values_of(ids: torch.Tensor, dim: int, step: int) -> torch.Tensor:
    """Distinct values for each (id, step)."""
    return (ids % 100_003).float()[:, None] + step * 0.01 + torch.arange(dim) * 0.001


def state_of(spec: TableSpec, ids: list[int] | torch.Tensor, step: int) -> dict[str, torch.Tensor]:
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return {
        "ids": ids,
        "values": values_of(ids, spec.embedding_dim, step),
        "slot.sum": torch.full((ids.numel(),), float(step)),
        "counts": torch.full((ids.numel(),), step, dtype=torch.int64),
    }


def write_scenario(directory: Path, spec: TableSpec, num_ps: int) -> list[FileRecord]:
    """Every PS of `num_ps` writes its rows of SCENARIO; the records, in the order written."""
    records = []
    for step, kind, changed, removed in SCENARIO:
        for ps_index in range(num_ps):
            ids = torch.tensor(changed, dtype=torch.int64)
            state = state_of(spec, ids[owners(spec, ids, num_ps) == ps_index], step)
            if kind == "increment":
                gone = torch.tensor(removed, dtype=torch.int64)
                state["removed"] = gone[owners(spec, gone, num_ps) == ps_index]
            record = write_shard(
                directory, spec, step=step, ps_index=ps_index, num_ps=num_ps, kind=kind, state=state,  # type: ignore[arg-type]
                scalars={"step": float(step)},
            )  # fmt: skip
            records.append(record)
    return records


def scenario_rows(spec: TableSpec) -> dict[int, torch.Tensor]:
    """The rows SCENARIO leaves, by id."""
    table = DictTable(spec)
    for step, _, changed, removed in SCENARIO:
        state = state_of(spec, changed, step)
        state["removed"] = torch.tensor(removed, dtype=torch.int64)
        table.load_rows(state)
    return table.rows


class DictTable:
    """PS `ps_index` of `num_ps`'s rows of a table, by id: a state loads the rows it owns, after its removed ids go."""

    def __init__(self, spec: TableSpec, ps_index: int = 0, num_ps: int = 1) -> None:
        self.spec, self.ps_index, self.num_ps = spec, ps_index, num_ps
        self.rows: dict[int, torch.Tensor] = {}

    def load_rows(self, state: dict[str, torch.Tensor]) -> None:
        for id_ in state.get("removed", torch.empty(0, dtype=torch.int64)).tolist():
            self.rows.pop(id_, None)
        mine = owners(self.spec, state["ids"], self.num_ps) == self.ps_index
        for id_, row in zip(state["ids"][mine].tolist(), state["values"][mine], strict=True):
            self.rows[id_] = row


def save_checkpoint(model_dir: Path, specs: list[TableSpec], num_ps: int = 2) -> Path:
    """A checkpoint in model_dir whose manifest lists the chains of SCENARIO written by `num_ps` PS for each of
    `specs`, their files staged in model_dir/tables and linked in after store.save (which lists only its model)."""
    staged = model_dir / "tables"
    records = [record for spec in specs for record in write_scenario(staged, spec, num_ps)]
    chain = chain_order(records)
    tables = {
        spec.name: {
            "spec": msgspec.to_builtins(spec),
            "chain": [f"tables/{r.path}" for r in chain if r.table == spec.name],
        }
        for spec in specs
    }
    checkpoint = store.save(model_dir, SCENARIO[-1][0], {"dense": torch.ones(2)}, {"tables": tables})
    link_into(checkpoint, staged, chain)
    return checkpoint
