"""The file that carries one PS's rows of one `sf.nn` table at one step: safetensors, written under a temporary name,
synced and renamed in, with the table's spec and the step in its metadata, and checked against its record on read.
A "full" file holds every row the PS owns; an "increment" the rows changed since its previous file and the ids
removed since then."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import google_crc32c
import msgspec
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shardflow.ps.embeddings.spec import TableSpec
from shardflow.structs import prepared

Kind = Literal["full", "increment"]

FORMAT = 1
"""The version of the metadata below; a reader refuses a newer one."""
METADATA_KEY = "shardflow.embeddings"
TEMPORARY = ".tmp-"
"""A file or directory under this prefix is a write in progress, never a table's file."""
_NAME = re.compile(r"step-(\d+)-ps-(\d+)-of-(\d+)-(full|increment)\.safetensors")
_CHUNK_BYTES = 4 << 20
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_PER_ROW_INT64 = ("counts", "last_seen")
_SLOT_DTYPES = (torch.float32, torch.int64)
PENDING = "pending."
"""A dynamic table's ids seen but not admitted yet ("pending.ids", "pending.counts", "pending.last_seen"): every
file holds them all (a bounded set), and the last file replayed decides."""


class FileRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One written file, as a PS reports it to the chief and the chief lists it in a manifest."""

    path: str
    """Relative to the directory holding the tables (model_dir/tables while staged, the checkpoint once linked),
    with "/" separators: `<table>/step-...safetensors`."""
    bytes: int
    crc32c: str
    """CRC-32C of the whole file, 8 hexadecimal digits, as the checkpoint manifest records files."""
    table: str
    step: int
    kind: Kind
    ps_index: int
    num_ps: int


class ShardMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a file says of itself besides its table's spec."""

    table: str
    step: int
    kind: Kind
    ps_index: int
    num_ps: int
    scalars: dict[str, float] = {}
    """The table's scalar state on that PS (a table-level optimizer step)."""


class _Header(msgspec.Struct, frozen=True, kw_only=True):
    format: int
    spec: TableSpec
    shard: ShardMeta


def check_table_name(name: str) -> None:
    """A table's name becomes a directory and file name: refuse one that could leave its directory or hide."""
    problem = None
    if not name:
        problem = "is empty"
    elif name.startswith("."):
        problem = 'starts with "."'
    elif ".." in name:
        problem = 'contains ".."'
    elif any(c in name for c in "/\\\0"):
        problem = 'contains "/", "\\" or a NUL'
    elif len(name.encode()) > 200:
        problem = "is longer than 200 bytes"
    if problem is not None:
        raise ValueError(f"table name {name!r} {problem}: name the module with a plain path such as 'towers.0.users'")


def file_name(step: int, ps_index: int, num_ps: int, kind: Kind) -> str:
    return f"step-{step:09d}-ps-{ps_index:05d}-of-{num_ps:05d}-{kind}.safetensors"


def record_of(path: str, size: int, crc32c: str) -> FileRecord:
    """The record of a file known by its relative path `[tables/]<table>/step-...`, its size and its CRC-32C."""
    parts = path.split("/")
    match = _NAME.fullmatch(parts[-1]) if len(parts) >= 2 else None
    if match is None:
        raise ValueError(f"{path!r} is not a table file's path (<table>/step-<step>-ps-<k>-of-<M>-<kind>.safetensors)")
    step, ps_index, num_ps, kind = match.groups()
    kind_: Kind = "full" if kind == "full" else "increment"
    return FileRecord(
        path=path, bytes=size, crc32c=crc32c, table=parts[-2], step=int(step), kind=kind_,
        ps_index=int(ps_index), num_ps=int(num_ps),
    )  # fmt: skip


def state_problem(spec: TableSpec, kind: Kind, state: dict[str, torch.Tensor]) -> str | None:
    """What is wrong with a table's state (see write_shard), or None."""
    ids, values = state.get("ids"), state.get("values")
    if ids is None or values is None:
        return "the state lacks 'ids' or 'values'"
    if ids.dtype != torch.int64 or ids.dim() != 1:
        return f"'ids' is {ids.dtype} {list(ids.shape)}, not int64 [n]"
    n, dim = ids.numel(), spec.embedding_dim
    if values.dtype != spec.torch_dtype or list(values.shape) != [n, dim]:
        return f"'values' is {values.dtype} {list(values.shape)}, not {spec.dtype} [{n}, {dim}]"
    if spec.num_embeddings is not None and n and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_embeddings):
        return f"an id is outside [0, {spec.num_embeddings}): {int(ids.min())}..{int(ids.max())}"
    for key, tensor in state.items():
        shape = list(tensor.shape)
        if key == "removed":
            if tensor.dtype != torch.int64 or tensor.dim() != 1:
                return f"'removed' is {tensor.dtype} {shape}, not int64 [m]"
            if kind == "full" and tensor.numel():
                return "a full file lists removed ids; only an increment removes rows"
        elif key in _PER_ROW_INT64 and (tensor.dtype != torch.int64 or shape != [n]):
            return f"{key!r} is {tensor.dtype} {shape}, not int64 [{n}]"
        elif key.startswith("slot.") and (tensor.dtype not in _SLOT_DTYPES or shape not in ([n], [n, dim])):
            return f"{key!r} is {tensor.dtype} {shape}, not float32 or int64 [{n}] or [{n}, {dim}]"
        elif key.startswith(PENDING) and (tensor.dtype != torch.int64 or tensor.dim() != 1):
            return f"{key!r} is {tensor.dtype} {shape}, not int64 [m]"
        elif key not in ("ids", "values", "removed", *_PER_ROW_INT64) and not key.startswith(("slot.", PENDING)):
            return (
                f"unknown entry {key!r}: a state holds ids, values, slot.<name>, counts, last_seen, removed, "
                f"{PENDING}<name>"
            )
    return None


def write_shard(
    directory: Path,
    spec: TableSpec,
    *,
    step: int,
    ps_index: int,
    num_ps: int,
    kind: Kind,
    state: dict[str, torch.Tensor],
    scalars: dict[str, float],
) -> FileRecord:
    """Write PS `ps_index`'s rows of `spec`'s table at `step` to `<directory>/<table>/<file_name>`, atomically: a
    crash or a full disk (OSError) leaves the file whole or absent. An existing file of that name is replaced by a
    new one (a new inode), so copies hard-linked into checkpoints never change."""
    check_table_name(spec.name)
    if step < 0 or not 0 <= ps_index < num_ps or kind not in ("full", "increment"):
        raise ValueError(f"table {spec.name!r}: no file for step {step}, ps {ps_index} of {num_ps}, kind {kind!r}")
    problem = state_problem(spec, kind, state)
    if problem is not None:
        raise ValueError(f"table {spec.name!r}, ps {ps_index}, step {step}: {problem}")
    shard = ShardMeta(table=spec.name, step=step, kind=kind, ps_index=ps_index, num_ps=num_ps, scalars=scalars)
    header = msgspec.json.encode(_Header(format=FORMAT, spec=spec, shard=shard)).decode()
    table_dir = Path(directory) / spec.name
    if not table_dir.is_dir():
        table_dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(table_dir.parent)
    name = file_name(step, ps_index, num_ps, kind)
    size, crc = write_atomically(table_dir / name, state, {METADATA_KEY: header})
    return FileRecord(
        path=f"{spec.name}/{name}", bytes=size, crc32c=crc, table=spec.name, step=step, kind=kind,
        ps_index=ps_index, num_ps=num_ps,
    )  # fmt: skip


def save_tensors(
    tensors: dict[str, torch.Tensor],
    path: Path,
    metadata: dict[str, str] | None = None,
    *,
    named: Path | None = None,
    save: Callable[..., None] = save_file,
) -> None:
    """safetensors' `save_file` (or `save`, the same), with an I/O error (a full disk) raised as the OSError it is,
    naming `named` (by default `path`): safetensors raises SafetensorError("... (os error 28)") instead."""
    try:
        extra = {"metadata": metadata} if metadata is not None else {}
        save({k: v.contiguous() for k, v in tensors.items()}, str(path), **extra)
    except SafetensorError as error:
        found = re.search(r"\(os error (\d+)\)", str(error))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(named or path)) from error


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write a safetensors file under a temporary name, sync it, rename it to `path`: its size and CRC-32C."""
    tmp = path.with_name(f"{TEMPORARY}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        save_tensors(tensors, tmp, metadata, named=path)
        size, crc = checksum(tmp, sync=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size, crc


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` under a temporary name, synced, renamed in."""
    tmp = path.with_name(f"{TEMPORARY}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def checksum(path: Path, *, sync: bool = False) -> tuple[int, str]:
    """Size and CRC-32C (hexadecimal) of a file, read in chunks; with `sync`, also fsynced."""
    crc = google_crc32c.Checksum()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, crc.hexdigest().decode()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(path: Path, expected: FileRecord | None = None) -> tuple[TableSpec, ShardMeta]:
    """A file's spec and meta, from its safetensors header alone; checked against `expected`'s table, step, kind
    and PS (not its bytes: see `verify`). A damaged header raises a ValueError naming the file and the offset."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: {size} bytes, shorter than a safetensors header's 8-byte length at offset 0")
        length = int.from_bytes(f.read(8), "little")
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{path}: the header length at offset 0 ({length}) does not fit the file's {size} bytes")
        raw = f.read(length)
    try:
        entries = msgspec.json.decode(raw, type=prepared(dict[str, Any]))
        metadata = msgspec.convert(entries.pop("__metadata__", {}), prepared(dict[str, str]))
    except msgspec.DecodeError as error:
        raise ValueError(f"{path}: the safetensors header at offsets 8..{8 + length} is malformed: {error}") from error
    _check_tensor_entries(path, entries, data_bytes=size - 8 - length)
    if METADATA_KEY not in metadata:
        raise ValueError(f"{path}: not a table file (its safetensors metadata has no {METADATA_KEY!r})")
    try:
        header = msgspec.json.decode(metadata[METADATA_KEY], type=prepared(_Header))
    except msgspec.DecodeError as error:
        raise ValueError(f"{path}: its {METADATA_KEY!r} metadata is malformed: {error}") from error
    if header.format > FORMAT:
        raise ValueError(f"{path}: written in table file format {header.format}, by a newer shardflow than this one")
    shard = header.shard
    if shard.table != header.spec.name:
        raise ValueError(f"{path}: its metadata names table {shard.table!r} and a spec of {header.spec.name!r}")
    if expected is not None:
        found = (shard.table, shard.step, shard.kind, shard.ps_index, shard.num_ps)
        wanted = (expected.table, expected.step, expected.kind, expected.ps_index, expected.num_ps)
        if found != wanted:
            raise ValueError(f"{path}: holds (table, step, kind, ps, num_ps) {found}, its record says {wanted}")
    return header.spec, shard


def _check_tensor_entries(path: Path, entries: dict[str, Any], data_bytes: int) -> None:
    for name, entry in entries.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = 1
            for extent in shape:
                numel *= int(extent)
            width = _DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}: tensor {name!r} in the safetensors header is malformed ({error!r})") from error
        if not 0 <= begin <= end <= data_bytes or end - begin != numel * width:
            raise ValueError(
                f"{path}: tensor {name!r} ({dtype} {shape}) at data offsets [{begin}, {end}) does not fit its "
                f"{numel * width} bytes into the {data_bytes} bytes of data after the header"
            )


def verify(path: Path, expected: FileRecord) -> None:
    """Raise a ValueError naming `path` unless its size and CRC-32C are `expected`'s."""
    size, crc = checksum(path)
    if size != expected.bytes:
        raise ValueError(f"{path}: {size} bytes, its record says {expected.bytes}")
    if crc != expected.crc32c:
        raise ValueError(f"{path}: CRC-32C {crc}, its record says {expected.crc32c}")


def read_tensors(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors `names` of a file (all where None), and only those: one table's values stay on disk while its
    ids are read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            present = f.keys()
            wanted = present if names is None else [name for name in names if name in set(present)]
            return {name: f.get_tensor(name) for name in wanted}
    except SafetensorError as error:
        raise ValueError(f"{path}: {error}") from error


def read_shard(path: Path, expected: FileRecord | None = None) -> tuple[TableSpec, ShardMeta, dict[str, torch.Tensor]]:
    """A file's spec, meta and state, verified against `expected` (size, CRC-32C, table, step, kind, PS) when
    given. A damaged or mismatching file raises a ValueError naming it."""
    path = Path(path)
    if expected is not None:
        verify(path, expected)
    spec, shard = read_header(path, expected)
    state = read_tensors(path)
    problem = state_problem(spec, shard.kind, state)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    return spec, shard, state
