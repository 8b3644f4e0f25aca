"""A trace as a Parquet table, one row per event, written in row groups while the trace streams in."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardflow.profile.trace import open_events

SCHEMA = pa.schema(
    [
        ("role", pa.string()),
        ("thread", pa.string()),
        ("pid", pa.int32()),
        ("tid", pa.int32()),
        ("ph", pa.string()),
        ("cat", pa.string()),
        ("name", pa.string()),
        ("step", pa.int64()),
        ("ts", pa.float64()),
        ("dur", pa.float64()),
        ("ps", pa.int32()),
        ("worker", pa.int32()),
        ("bytes", pa.int64()),
        ("cpu_ns", pa.int64()),
        ("flow_id", pa.int64()),
        ("value", pa.float64()),
        ("op", pa.string()),
        ("source", pa.string()),
        ("shape", pa.string()),
        ("device", pa.string()),
        ("addr", pa.int64()),
    ]
)
_ARG_COLUMNS = ("ps", "worker", "bytes", "cpu_ns", "op", "source", "shape", "device", "addr")
ROWS_PER_GROUP = 1 << 17


_METADATA_KEY = b"shardflow.trace"


def build_table(trace_path: str | Path, out_path: str | Path) -> Path:
    """The table of a trace file, streamed from it."""
    metadata, stream = open_events(trace_path)
    return write_table(stream, out_path, metadata)


def write_table(
    trace_events: Iterable[dict[str, Any]], out_path: str | Path, metadata: dict[str, Any] | None = None
) -> Path:
    """Converts `ROWS_PER_GROUP` events at a time, so only one batch of columns is alive next to the stream; names
    (ph "M") must come before the events of their process and thread, as in the traces shardflow writes.
    `metadata` (the trace's otherData: roles, their hosts and clocks) goes with the table, see `trace_metadata`."""
    out_path = Path(out_path)
    temporary = out_path.with_name(out_path.name + ".partial")
    roles: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    columns: dict[str, list[Any]] = {field.name: [] for field in SCHEMA}
    schema = SCHEMA.with_metadata({_METADATA_KEY: orjson.dumps(metadata or {})})
    with pq.ParquetWriter(temporary, schema, compression="zstd") as writer:
        for event in trace_events:
            phase = event.get("ph")
            if phase == "M":
                _remember_name(event, roles, threads)
                continue
            _append_row(columns, event, roles, threads)
            if len(columns["ph"]) >= ROWS_PER_GROUP:
                writer.write_table(pa.table(columns, schema=schema))
                columns = {name: [] for name in columns}
        writer.write_table(pa.table(columns, schema=schema))
    temporary.replace(out_path)
    return out_path


def _remember_name(event: dict[str, Any], roles: dict[int, str], threads: dict[tuple[int, int], str]) -> None:
    if event.get("name") == "process_name":
        roles[event["pid"]] = event["args"]["name"]
    elif event.get("name") == "thread_name":
        threads[(event["pid"], event["tid"])] = event["args"]["name"]


def _append_row(
    columns: dict[str, list[Any]], event: dict[str, Any], roles: dict[int, str], threads: dict[tuple[int, int], str]
) -> None:
    pid, tid = event.get("pid", 0), event.get("tid", 0)
    args = event.get("args", {})
    columns["role"].append(roles.get(pid, str(pid)))
    columns["thread"].append(threads.get((pid, tid), str(tid)))
    columns["pid"].append(pid)
    columns["tid"].append(tid)
    columns["ph"].append(event.get("ph"))
    columns["cat"].append(event.get("cat"))
    columns["name"].append(event.get("name"))
    columns["step"].append(args.get("step"))
    columns["ts"].append(event.get("ts"))
    columns["dur"].append(event.get("dur"))
    columns["flow_id"].append(event.get("id"))
    columns["value"].append(args.get("value") if event.get("ph") == "C" else None)
    for name in _ARG_COLUMNS:
        columns[name].append(args.get(name))


Filter = Callable[[pa.Table], np.ndarray]
"""A row mask over the events table, a small callable; combine masks with &."""


def load(path: str | Path) -> pa.Table:
    return pq.read_table(path)


def trace_metadata(table: pa.Table | str | Path) -> dict[str, Any]:
    """The otherData of the trace a table (or the table's file, of which only the footer is read) was built from;
    empty for tables written without it."""
    schema = pq.read_schema(table) if isinstance(table, str | Path) else table.schema
    metadata: dict[str, Any] = orjson.loads((schema.metadata or {}).get(_METADATA_KEY, b"{}"))
    return metadata


def name_matches(pattern: str) -> Filter:
    """Rows whose name matches the Python regex (searched, not anchored)."""
    regex = re.compile(pattern)

    def mask(table: pa.Table) -> np.ndarray:
        encoded = pc.dictionary_encode(pc.fill_null(table["name"], "")).combine_chunks()
        matches = np.array([bool(regex.search(name)) for name in encoded.dictionary.to_pylist()], dtype=bool)
        return matches[encoded.indices.to_numpy(zero_copy_only=False)] if len(matches) else np.zeros(0, dtype=bool)

    return mask


def in_steps(first: int, last: int) -> Filter:
    """Rows of global steps [first, last)."""

    def mask(table: pa.Table) -> np.ndarray:
        inside = pc.and_(pc.greater_equal(table["step"], first), pc.less(table["step"], last))
        return np.asarray(pc.fill_null(inside, False).to_numpy(zero_copy_only=False), dtype=bool)

    return mask
