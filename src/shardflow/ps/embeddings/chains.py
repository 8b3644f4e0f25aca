"""A table's checkpoint is a chain of files: for each PS of the job that wrote it, a full file, then that PS's
increments in step order. Here: the order of a chain and its checks, replaying one into a callback, a chain's place
in a checkpoint (`tables/<table>/<file>`, listed in the manifest) and the staged files that chains no longer need."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import google_crc32c
import msgspec
import torch

from shardflow.ps.embeddings.files import (
    TEMPORARY,
    FileRecord,
    ShardMeta,
    check_table_name,
    fsync_dir,
    read_header,
    read_shard,
    record_of,
)
from shardflow.ps.embeddings.spec import TableSpec
from shardflow.structs import prepared

TABLES = "tables"
"""The directory of table files in a checkpoint, and in model_dir while the PS stage them."""
_CHUNK_BYTES = 4 << 20
# A hard link cannot cross filesystems (EXDEV), may be refused by the filesystem (EPERM, ENOTSUP) or exceed the
# inode's link count (EMLINK): those are copied instead. Any other error is real.
_COPY_INSTEAD = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


class Shard(Protocol):
    @property
    def table(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def ps_index(self) -> int: ...
    @property
    def num_ps(self) -> int: ...


S = TypeVar("S", bound=Shard)
Files = Sequence[tuple[Path, FileRecord | None]]
"""A chain's files, each with its record where one is known (see `chain_files`)."""


def chain_order(records: Iterable[S]) -> list[S]:
    """Each table's chain (tables by name): every PS's latest full file and its increments after it, in step order,
    each step's files in PS order. Older files are left out. Each PS's files hold only its own rows, so its chain
    replays on its own; the PS usually write their full files at the same step (each counts its saves, see
    TableShards.save), but a snapshot that reached one PS only (a chief that died as it asked for it) leaves one a
    full file ahead, and a chief that resumes from the live PS reads each one's state at its own step: a chain then
    starts later than the others'. Every PS's files end at one step, and every PS has one at each step after the
    latest full file. Raises a ValueError naming the table, step and PS where a step lacks a PS's file or has two."""
    by_table: dict[str, dict[tuple[int, str, int], S]] = {}
    for record in records:
        group = by_table.setdefault(record.table, {})
        key = (record.step, record.kind, record.ps_index)
        if key in group and group[key] != record:  # the same record twice (a retried reply) is one file
            raise ValueError(
                f"table {record.table!r}: two different {record.kind} files of step {record.step}, ps {record.ps_index}"
            )
        group[key] = record
    return [record for table in sorted(by_table) for record in _table_chain(table, list(by_table[table].values()))]


def _table_chain(table: str, records: list[S]) -> list[S]:
    fulls = [r for r in records if r.kind == "full"]
    if not fulls:
        raise ValueError(f"table {table!r}: no full file; a chain starts with one full file per PS")
    start = max(r.step for r in fulls)
    num_ps = _one_per_ps(table, "full", start, [r for r in fulls if r.step == start], None, partial=True)
    chain: list[S] = []
    missing, ends = [], {}
    for k in range(num_ps):
        own = [r for r in fulls if r.ps_index == k and r.num_ps == num_ps]
        if not own:
            missing.append(k)
            continue
        first = max(r.step for r in own)
        # Up to the latest full step, this PS's increments after its own full file, whatever the others saved.
        behind = [r for r in records if r.kind == "increment" and r.ps_index == k and first < r.step <= start]
        for r in behind:
            _one_per_ps(table, "increment", r.step, [r], num_ps, partial=True)  # of a job of as many PS
        chain += [r for r in own if r.step == first] + behind
        ends[k] = max(r.step for r in [*own, *behind])
    if missing:
        raise ValueError(f"table {table!r}: the full files of step {start} lack ps {missing} of {num_ps}")
    increments: dict[int, list[S]] = {}
    for r in records:
        if r.kind == "increment" and r.step > start:
            increments.setdefault(r.step, []).append(r)
    for step in sorted(increments):
        _one_per_ps(table, "increment", step, increments[step], num_ps)
        chain += increments[step]
    if not increments and len(set(ends.values())) > 1:  # every PS's files end at the checkpoint's step
        end = max(ends.values())
        short = [k for k, step in ends.items() if step != end]
        raise ValueError(f"table {table!r}: the files of step {end} lack ps {short} of {num_ps}")
    return sorted(chain, key=lambda r: (r.step, r.ps_index))


def _one_per_ps(table: str, kind: str, step: int, records: list[S], num_ps: int | None, partial: bool = False) -> int:
    """The number of PS of `records`, one file of each PS (of a `partial` step: at most one), else a ValueError."""
    where = f"table {table!r}: the {kind} files of step {step}"
    counts = sorted({r.num_ps for r in records})
    if num_ps is None and len(counts) > 1:
        raise ValueError(f"{where} were written by jobs of {counts} PS")
    num_ps = counts[0] if num_ps is None else num_ps
    if counts != [num_ps]:
        raise ValueError(f"{where} were written by jobs of {counts} PS, the chain's full files by {num_ps}")
    by_ps = {r.ps_index: r for r in records}  # one each: chain_order kept one record per (step, kind, PS)
    missing = [] if partial else [k for k in range(num_ps) if k not in by_ps]
    extra = sorted(set(by_ps) - set(range(num_ps)))
    if missing or extra:
        raise ValueError(f"{where} lack ps {missing} of {num_ps}" + (f" and name ps {extra}" if extra else ""))
    return num_ps


def check_chain(files: Files, spec: TableSpec) -> list[ShardMeta]:
    """The metas of a chain's files, from their headers alone, once the chain is checked whole: every file of
    `spec`'s table and dimension, named for what it holds, and in chain order with none missing."""
    metas = []
    for path, expected in files:
        file_spec, meta = read_header(path, expected)
        named = record_of(f"{path.parent.name}/{path.name}", 0, "")
        if (named.table, named.step, named.kind, named.ps_index, named.num_ps) != (
            meta.table, meta.step, meta.kind, meta.ps_index, meta.num_ps,
        ):  # fmt: skip
            raise ValueError(f"{path}: its name does not say what it holds: {meta}")
        if (meta.table, file_spec.embedding_dim, file_spec.dtype) != (spec.name, spec.embedding_dim, spec.dtype):
            raise ValueError(
                f"{path}: holds table {meta.table!r} of {file_spec.embedding_dim} {file_spec.dtype}, "
                f"not {spec.name!r} of {spec.embedding_dim} {spec.dtype}"
            )
        metas.append(meta)
    ordered = chain_order(metas)
    if [id(m) for m in ordered] != [id(m) for m in metas]:
        names = ", ".join(f"{m.kind}@{m.step}/ps{m.ps_index}" for m in ordered)
        raise ValueError(f"table {spec.name!r}: the files are not a chain in order; it would be: {names}")
    return metas


def replay(
    files: Files,
    spec: TableSpec,
    on_state: Callable[[dict[str, torch.Tensor]], None],
) -> list[ShardMeta]:
    """Feed each file's state to `on_state` (a PS's load_rows) in order, one file in memory at a time, after the
    chain is checked whole (`check_chain`); each file is verified against its record, where given, before its state
    is fed. A damaged file raises after the states before it were fed: the caller drops what it loaded. The metas
    of the files, in order (their scalars are each PS's)."""
    metas = check_chain(files, spec)
    for path, expected in files:
        _, _, state = read_shard(path, expected)
        on_state(state)
        del state  # before the next file is read
    return metas


def table_chains(manifest: Mapping[str, Any]) -> dict[str, tuple[TableSpec, list[str]]]:
    """Each table's spec and chain (paths relative to the checkpoint, in replay order) from a checkpoint's manifest
    (its "tables"); none for a checkpoint without tables."""
    tables = manifest.get("tables", {})
    if not isinstance(tables, dict):
        raise ValueError("the manifest's 'tables' is not a JSON object")
    chains = {}
    for name, entry in tables.items():
        try:
            spec = msgspec.convert(entry["spec"], prepared(TableSpec))
            chain = msgspec.convert(entry["chain"], prepared(list[str]))
        except (KeyError, TypeError, msgspec.ValidationError) as error:
            raise ValueError(f"the manifest's entry of table {name!r} is malformed: {error!r}") from error
        check_table_name(name)
        if spec.name != name:
            raise ValueError(f"the manifest's entry of table {name!r} holds the spec of {spec.name!r}")
        if not chain:
            raise ValueError(
                f"the manifest's chain of table {name!r} lists no files; it starts with a full file per PS"
            )
        for path in chain:
            if record_of(path, 0, "").table != name or path.split("/")[0] != TABLES or path.count("/") != 2:
                raise ValueError(f"the manifest's chain of table {name!r} names {path!r}, not {TABLES}/{name}/<file>")
        chains[name] = (spec, chain)
    return chains


def chain_files(
    checkpoint: Path, manifest: Mapping[str, Any], chain: list[str]
) -> list[tuple[Path, FileRecord | None]]:
    """The chain's files in `checkpoint`, each with its record from the manifest's "files", None where it lists none
    (then the file is checked by its own header only)."""
    files = manifest.get("files", {})
    found: list[tuple[Path, FileRecord | None]] = []
    for path in chain:
        entry = files.get(path)
        found.append((checkpoint / path, None if entry is None else record_of(path, entry["bytes"], entry["crc32c"])))
    return found


def link_into(checkpoint: Path, table_dir: Path, records: Iterable[FileRecord]) -> dict[str, dict[str, Any]]:
    """Hard-link the staged files of `records` (under `table_dir`) into the checkpoint being built at
    `checkpoint`, as `tables/<record's path>`; copied where a hard link cannot be made. Their entries for the
    manifest's "files", from the records: a linked file is not read again (its size is checked)."""
    entries: dict[str, dict[str, Any]] = {}
    made: list[Path] = []
    for record in records:
        source, relative = table_dir / record.path, f"{TABLES}/{record.path}"
        target = checkpoint / relative
        if target.parent not in made:
            target.parent.mkdir(parents=True, exist_ok=True)
            made.append(target.parent)
        size = source.stat().st_size
        if size != record.bytes:
            raise ValueError(f"{source}: {size} bytes, its record says {record.bytes}")
        try:
            os.link(source, target)
        except OSError as error:
            if error.errno not in _COPY_INSTEAD:
                raise
            _copy(source, target, record)
        entries[relative] = {"bytes": record.bytes, "crc32c": record.crc32c}
    for directory in [*made, checkpoint / TABLES]:
        fsync_dir(directory)
    return entries


def _copy(source: Path, target: Path, record: FileRecord) -> None:
    """Copy a staged file, checking it against its record on the way (it is read anyway)."""
    crc = google_crc32c.Checksum()
    with open(source, "rb") as reader, open(target, "xb") as writer:
        while chunk := reader.read(_CHUNK_BYTES):
            crc.update(chunk)
            writer.write(chunk)
        writer.flush()
        os.fsync(writer.fileno())
    if crc.hexdigest().decode() != record.crc32c:
        target.unlink()
        raise ValueError(f"{source}: CRC-32C {crc.hexdigest().decode()}, its record says {record.crc32c}")


def prune_staged(table_dir: Path, keep: set[str], *, through_step: int) -> list[str]:
    """Delete the staged files of steps up to `through_step` whose paths (relative to `table_dir`) are not in
    `keep`: those no chain of a kept checkpoint needs. Files of later steps may belong to a checkpoint still being
    saved and stay; so do temporaries. Copies linked into checkpoints stay there. The paths deleted."""
    deleted = []
    for path in sorted(Path(table_dir).glob("*/step-*.safetensors")):
        relative = f"{path.parent.name}/{path.name}"
        try:
            step = record_of(relative, 0, "").step
        except ValueError:
            continue  # not a table file: not ours to delete
        if relative not in keep and step <= through_step:
            path.unlink(missing_ok=True)
            deleted.append(relative)
    return deleted


def remove_temporaries(table_dir: Path, ps_index: int) -> int:
    """Delete what interrupted writes of PS `ps_index` left under `table_dir`; at that PS's start, before it writes.
    How many."""
    found = list(Path(table_dir).glob(f"*/{TEMPORARY}step-*-ps-{ps_index:05d}-of-*"))
    for path in found:
        path.unlink(missing_ok=True)
    return len(found)
