"""`sf.nn` tables in this one process: for a model run outside a job (a notebook, a test, the one-process loop a
job is compared with), with the same rows, initializers and row optimizers the PS would apply."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import msgspec
import torch

from shardflow.nn import backend
from shardflow.nn.modules import TableModule, tables
from shardflow.ps.embeddings.table import ShardTable
from shardflow.ps.optimizers import OptimizerLike, as_optimizer_spec


class LocalTables:
    """Every `sf.nn` table of a model, whole, in this process. After each backward, `step()` applies the rows'
    gradients with each table's row optimizer (the job's optimizer in its sparse form where it names none)."""

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerLike | None = None) -> None:
        spec = as_optimizer_spec(optimizer) if optimizer is not None else None
        self.tables: dict[str, ShardTable] = {}
        for name, module in tables(model).items():
            table = module.spec()
            if table.optimizer is None:
                if spec is None:
                    raise ValueError(f"sf.nn table {name!r} names no optimizer: pass local_tables(model, optimizer)")
                table = msgspec.structs.replace(table, optimizer=spec.rows(table))
            assert table.optimizer is not None
            self.tables[name] = ShardTable(table, table.optimizer, 0, 1)
        self.global_step = 0
        self._looked: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def lookup(self, table: TableModule, ids: torch.Tensor) -> backend.Looked:
        flat = ids.detach().reshape(-1).to("cpu", torch.int64)
        unique, inverse = torch.unique(flat, return_inverse=True)
        shard = self.tables[table.table_name or ""]
        shard.check_ids(unique, f"a lookup of sf.nn table {table.table_name!r}")
        rows = shard.lookup(unique).to(ids.device)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            counts = torch.bincount(inverse, minlength=unique.numel())
            self._looked.append((table.table_name or "", unique, counts, rows))
        return backend.Looked(rows, inverse.to(ids.device).view(ids.shape), unique)

    def step(self) -> None:
        """Apply the gradients of the rows looked up since the last step, as one update (a global step)."""
        self.global_step += 1
        by_table: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for name, unique, counts, rows in self._looked:
            grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
            by_table.setdefault(name, []).append((unique, counts, grad.detach().cpu()))
        for name, table in self.tables.items():
            found = by_table.get(name, [])
            dim = table.spec.embedding_dim
            ids = torch.cat([f[0] for f in found]) if found else torch.empty(0, dtype=torch.int64)
            counts = torch.cat([f[1] for f in found]) if found else torch.empty(0, dtype=torch.int64)
            grads = torch.cat([f[2] for f in found]) if found else torch.empty((0, dim))
            table.apply(ids, counts, grads, step=self.global_step)
            table.maintain(self.global_step)
        self._looked = []

    def zero_grad(self) -> None:
        """Forget the rows looked up since the last step without applying their gradients."""
        self._looked = []


@contextlib.contextmanager
def local_tables(model: torch.nn.Module, optimizer: OptimizerLike | None = None) -> Iterator[LocalTables]:
    """Run `model`'s `sf.nn` tables in this process inside the block:

    with sf.nn.local_tables(model, sf.optim.Adagrad(lr=0.05)) as tables:
        loss_fn(model, batch).backward(); tables.step()
    """
    local = LocalTables(model, optimizer)
    with backend.installed(local):
        yield local
