"""Trace files: gzipped Chrome Trace Event JSON written one event per line, so it can be read as a stream."""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import orjson

_HEAD, _TAIL = b'{"otherData":', b',"traceEvents":['
_ROLE = re.compile(r"(?P<kind>[a-z_]+)(?::(?P<index>\d+))?")
_KIND_ORDER = {"chief": 0, "worker": 1, "ps": 2}


def role_sort_key(role: str) -> tuple[int, str, int]:
    """chief first, then workers, then PS, each by index; other roles (evaluator) last."""
    match = _ROLE.fullmatch(role)
    kind = match["kind"] if match else role
    index = int(match["index"]) if match and match["index"] else 0
    return _KIND_ORDER.get(kind, len(_KIND_ORDER)), kind, index


def write_trace(trace: dict[str, Any], path: str | Path) -> Path:
    """Writes otherData on the first line and each event on its own line; any JSON reader reads it whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".partial")
    with gzip.open(temporary, "wb", compresslevel=3) as file:
        file.write(_HEAD + orjson.dumps(trace.get("otherData", {})) + _TAIL + b"\n")
        events = trace["traceEvents"]
        for i, event in enumerate(events):
            file.write(orjson.dumps(event) + (b",\n" if i + 1 < len(events) else b"\n"))
        file.write(b'],"displayTimeUnit":"ms"}\n')
    temporary.replace(path)
    return path


def read_trace(path: str | Path) -> dict[str, Any]:
    metadata, events = open_events(path)
    return {"traceEvents": list(events), "displayTimeUnit": "ms", "otherData": metadata}


def open_events(path: str | Path) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """(otherData, an iterator over the events): line by line for our own files, else one parse of the whole."""
    file = _open(Path(path))
    first = file.readline().rstrip(b"\n")
    if first.startswith(_HEAD) and first.endswith(_TAIL):
        return orjson.loads(first[len(_HEAD) : -len(_TAIL)]), _iter_lines(file)
    whole = orjson.loads(first + file.read())
    file.close()
    events = whole.pop("traceEvents", []) if isinstance(whole, dict) else whole
    metadata = whole.get("otherData", {}) if isinstance(whole, dict) else {}
    events.sort(key=lambda event: event.get("ph") != "M")  # names first, as in our own files
    return metadata, iter(events)


def check_legal(trace: dict[str, Any]) -> list[str]:
    """What would make chrome://tracing or Perfetto reject or misdraw the trace; empty when legal."""
    problems: list[str] = []
    try:
        orjson.loads(orjson.dumps(trace))
    except orjson.JSONEncodeError as error:
        return [f"not JSON: {error}"]
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    open_begins: dict[tuple[int, int], list[str]] = {}
    named_processes = set()
    for event in trace["traceEvents"]:
        phase = event.get("ph")
        where = (event.get("pid", 0), event.get("tid", 0))
        if phase == "M":
            if event.get("name") == "process_name":
                named_processes.add(where[0])
            continue
        if not isinstance(event.get("ts"), int | float):
            problems.append(f"{event.get('name')!r}: ts is not a number")
            continue
        if phase == "X":
            if not isinstance(event.get("dur"), int | float) or event["dur"] < 0:
                problems.append(f"{event.get('name')!r} at {event['ts']}: dur is not a number >= 0")
                continue
            start = round(event["ts"] * 1000)
            tracks.setdefault(where, []).append((start, start + round(event["dur"] * 1000), event.get("name", "")))
        elif phase == "B":
            open_begins.setdefault(where, []).append(event.get("name", ""))
        elif phase == "E" and not open_begins.get(where, []):
            problems.append(f"E event without a B on pid/tid {where}")
        elif phase == "E":
            open_begins[where].pop()
    problems += [f"{len(names)} B events never end on pid/tid {where}" for where, names in open_begins.items() if names]
    for where, spans in tracks.items():
        problems += _misnested(where, spans)
    problems += [f"pid {pid} has no process_name" for pid in {pid for pid, _ in tracks} - named_processes]
    return problems


def _misnested(where: tuple[int, int], spans: list[tuple[int, int, str]]) -> list[str]:
    problems = []
    stack: list[tuple[int, int, str]] = []
    for start, end, name in sorted(spans, key=lambda span: (span[0], -span[1])):
        while stack and stack[-1][1] <= start:
            stack.pop()
        if stack and end > stack[-1][1]:
            problems.append(f"{name!r} at {start} ns overlaps {stack[-1][2]!r} without nesting on pid/tid {where}")
        stack.append((start, end, name))
    return problems


def _open(path: Path) -> BinaryIO:
    with path.open("rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    return cast(BinaryIO, gzip.open(path, "rb")) if gzipped else path.open("rb")


def _iter_lines(file: BinaryIO) -> Iterator[dict[str, Any]]:
    with file:
        for line in file:
            if line.startswith(b"{"):
                yield orjson.loads(line.rstrip(b",\n"))
