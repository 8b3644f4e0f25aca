"""An `sf.nn` table's rows as a checkpoint keeps them, gathered from every PS's chain without a PS: sorted ids and
their values, written out for serving (`export_tables`, behind `shardflow export --embeddings`) or looked up by the
evaluator (`CheckpointRows`)."""

from __future__ import annotations

import glob
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from shardflow.ps.embeddings.chains import Files, chain_files, check_chain, table_chains
from shardflow.ps.embeddings.files import (
    ShardMeta,
    read_tensors,
    verify,
    write_atomically,
    write_bytes_atomically,
)
from shardflow.ps.embeddings.spec import TableSpec
from shardflow.train.checkpoints import store

INDEX = "index.json"
MAX_FILE_BYTES = 2 << 30
"""A table whose ids and values take more is written in several files, each a contiguous range of sorted ids."""


class ExportedFile(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    """Relative to the export's directory."""
    rows: int
    bytes: int
    crc32c: str
    first_id: int | None
    last_id: int | None


class ExportedTable(msgspec.Struct, frozen=True, kw_only=True):
    table: str
    dim: int
    rows: int
    dtype: str
    spec: TableSpec
    files: list[ExportedFile]


def gather_rows(files: Files, spec: TableSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A table's rows after its whole chain: ids (int64, sorted) and values [rows, dim]. Two passes: the ids of
    every file first, to learn which file holds each surviving row's last values; then each file's values, copied
    straight to their rows. So the table's values are held once, plus one file's."""
    metas = check_chain(files, spec)
    ids, source_file, source_row = _final_sources(files, metas)
    order = torch.argsort(ids)
    ids, source_file, source_row = ids[order], source_file[order], source_row[order]
    values = torch.empty(ids.numel(), spec.embedding_dim, dtype=spec.torch_dtype)
    for index, (path, _) in enumerate(files):
        at = (source_file == index).nonzero().squeeze(1)
        if at.numel():
            file_values = read_tensors(path, ["values"])["values"]
            if file_values.dtype != values.dtype or file_values.shape[1:] != values.shape[1:]:
                raise ValueError(f"{path}: 'values' is {file_values.dtype} {list(file_values.shape)}")
            values[at] = file_values[source_row[at]]
            del file_values
    return ids, values


def _final_sources(files: Files, metas: list[ShardMeta]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each id left after the chain, with the file (its index in `files`) and the row there of its last values.
    An increment's removed ids go before its rows come: an id removed and admitted again between two saves stays."""
    ids = torch.empty(0, dtype=torch.int64)
    source_file = torch.empty(0, dtype=torch.int32)
    source_row = torch.empty(0, dtype=torch.int64)
    for index, ((path, expected), meta) in enumerate(zip(files, metas, strict=True)):
        if expected is not None:
            verify(path, expected)
        state = read_tensors(path, ["ids", "removed"])
        new = state["ids"]
        if new.dtype != torch.int64 or new.dim() != 1 or torch.unique(new).numel() != new.numel():
            raise ValueError(f"{path}: 'ids' is not a vector of distinct int64 ids")
        if meta.kind == "increment":
            keep = ~_isin(ids, torch.cat([new, state.get("removed", new[:0])]))
            ids, source_file, source_row = ids[keep], source_file[keep], source_row[keep]
        ids = torch.cat([ids, new])
        source_file = torch.cat([source_file, torch.full_like(new, index, dtype=torch.int32)])
        source_row = torch.cat([source_row, torch.arange(new.numel())])
        if meta.kind == "full" and (index + 1 == len(metas) or metas[index + 1].kind != "full"):
            _check_disjoint(files, ids, source_file)
    return ids, source_file, source_row


def _isin(elements: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """torch.isin for a large `elements` and a smaller `test`: a binary search of each element in the sorted
    `test`, where torch.isin would sort both together (measured: 15x the memory of `elements` at 2M ids)."""
    if not test.numel():
        return torch.zeros_like(elements, dtype=torch.bool)
    test = torch.sort(test).values
    return test[torch.searchsorted(test, elements).clamp_(max=test.numel() - 1)] == elements


def _check_disjoint(files: Files, ids: torch.Tensor, source_file: torch.Tensor) -> None:
    """The full files of a step are each PS's own rows: an id in two of them is a table split wrongly."""
    order = torch.argsort(ids)
    ordered = ids[order]
    twice = (ordered[1:] == ordered[:-1]).nonzero()
    if twice.numel():
        at = int(twice[0])
        first, second = (files[int(source_file[order[k]])][0] for k in (at, at + 1))
        raise ValueError(f"id {int(ordered[at])} is in two full files, {first} and {second}")


def _chains(checkpoint: Path) -> tuple[dict[str, Any], dict[str, tuple[TableSpec, list[str]]]]:
    manifest = store.read_manifest(checkpoint)
    chains = table_chains(manifest)
    if not chains:
        raise ValueError(f"checkpoint {checkpoint} holds no sf.nn tables")
    return manifest, chains


def _unknown(checkpoint: Path, chains: dict[str, Any], names: list[str]) -> None:
    unknown = [name for name in names if name not in chains]
    if unknown:
        raise ValueError(f"checkpoint {checkpoint} has no table {', '.join(unknown)}; its tables: {', '.join(chains)}")


def export_tables(
    checkpoint: Path, out_dir: Path, tables: list[str] | None = None, *, max_file_bytes: int = MAX_FILE_BYTES
) -> list[ExportedTable]:
    """Write each table of the checkpoint (or those named) to `<out_dir>/<table>.safetensors`: "ids" (int64,
    sorted) and "values" ([rows, dim]); over `max_file_bytes`, to `<table>-<i>-of-<n>.safetensors`, each a range
    of the sorted ids. Then `<out_dir>/index.json` describes the tables written (dim, rows, dtype, spec, files).
    One table's rows are in memory at a time."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    manifest, chains = _chains(checkpoint)
    names = sorted(chains) if tables is None else list(dict.fromkeys(tables))
    _unknown(checkpoint, chains, names)
    out_dir.mkdir(parents=True, exist_ok=True)
    step = int(manifest["global_step"])
    exported = []
    for name in names:
        spec, chain = chains[name]
        ids, values = gather_rows(chain_files(checkpoint, manifest, chain), spec)
        exported.append(_write_table(out_dir, spec, ids, values, step, max_file_bytes))
        del ids, values
    index = {"checkpoint": checkpoint.name, "global_step": step, "tables": {t.table: t for t in exported}}
    write_bytes_atomically(out_dir / INDEX, msgspec.json.format(msgspec.json.encode(index)))
    return exported


def _write_table(
    out_dir: Path, spec: TableSpec, ids: torch.Tensor, values: torch.Tensor, step: int, max_file_bytes: int
) -> ExportedTable:
    rows, dim = values.shape
    rows_per_file = max(1, max_file_bytes // (dim * values.element_size() + ids.element_size()))
    num_files = max(1, -(-rows // rows_per_file))
    metadata = {"table": spec.name, "global_step": str(step), "spec": msgspec.json.encode(spec).decode()}
    files = []
    for part in range(num_files):
        name = f"{spec.name}-{part:05d}-of-{num_files:05d}.safetensors" if num_files > 1 else f"{spec.name}.safetensors"
        begin, end = part * rows_per_file, min(rows, (part + 1) * rows_per_file)
        # Row slices of contiguous tensors are contiguous: written without a copy.
        size, crc = write_atomically(out_dir / name, {"ids": ids[begin:end], "values": values[begin:end]}, metadata)
        first, last = (int(ids[begin]), int(ids[end - 1])) if end > begin else (None, None)
        files.append(ExportedFile(path=name, rows=end - begin, bytes=size, crc32c=crc, first_id=first, last_id=last))
    written = {f.path for f in files}
    for stale in [out_dir / f"{spec.name}.safetensors", *out_dir.glob(f"{glob.escape(spec.name)}-*-of-*.safetensors")]:
        if stale.name not in written:  # left by an earlier export cut differently
            stale.unlink(missing_ok=True)
    return ExportedTable(table=spec.name, dim=dim, rows=rows, dtype=spec.dtype, spec=spec, files=files)


class CheckpointRows:
    """A read-only lookup of one table's rows in a checkpoint, for the evaluator and for tests: an id the
    checkpoint does not hold reads `default(ids)` (the table's initial rows)."""

    def __init__(self, checkpoint: Path, table: str, default: Callable[[torch.Tensor], torch.Tensor]) -> None:
        checkpoint = Path(checkpoint)
        manifest, chains = _chains(checkpoint)
        _unknown(checkpoint, chains, [table])
        self.spec, chain = chains[table]
        self.ids, self.values = gather_rows(chain_files(checkpoint, manifest, chain), self.spec)
        self._default = default

    def __len__(self) -> int:
        return self.ids.numel()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The values of `ids` (any shape): shape [*ids.shape, dim]."""
        flat = ids.reshape(-1).to(torch.int64)
        out = torch.empty(flat.numel(), self.spec.embedding_dim, dtype=self.values.dtype)
        found = torch.zeros(flat.numel(), dtype=torch.bool)
        if len(self):
            position = torch.searchsorted(self.ids, flat).clamp_(max=len(self) - 1)
            found = self.ids[position] == flat
            out[found] = self.values[position[found]]
        if not found.all():
            out[~found] = self._default(flat[~found]).to(out.dtype)
        return out.reshape(*ids.shape, self.spec.embedding_dim)
