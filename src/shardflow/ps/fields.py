"""Checks of PS message header fields as they come off the wire, shared by requests (ps/protocol.py) and replies
(ps/replies.py): types (a bool is not an int), ranges, required and unknown fields, frame groups."""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

ENVELOPE = ("op", "s", "q")
"""Keys comm/ sets in a request or reply header: the op name, the sender and the sequence number."""
MAX_INT = 2**63 - 1
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlist, _repr.maxdict, _repr.maxlevel = 6, 4, 2
short = _repr.repr


class PSProtocolError(ValueError):
    """A request or reply that breaks the PS protocol; names the op, the field and the sender."""

    def __init__(self, op: object, field: str, sender: str, problem: str) -> None:
        self.op, self.field, self.sender = op, field, sender
        super().__init__(f"{short(op)} from {sender}: {field} {problem}")


class Invalid(Exception):
    """Raised inside a decoder; decode_request and the reply decoders add the op and the sender."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field, self.problem = field, problem


def check_keys(header: dict[Any, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    for name in required:
        if name not in header:
            raise Invalid(name, "is missing")
    unexpected = len(header) - len(required)
    for name in optional:
        if name in header:
            unexpected -= 1
    for key in ENVELOPE:
        if key in header:
            unexpected -= 1
    if unexpected:
        unknown = sorted(repr(key) for key in header if key not in (*required, *optional, *ENVELOPE))
        raise Invalid(unknown[0], f"is not a field of this message (it has {', '.join(required + optional)})")


def int_field(header: dict[Any, Any], name: str, below: int | None = None) -> int:
    value = header[name]
    # type() rather than isinstance(): a bool is an int to Python, never a step or an index here.
    if type(value) is not int or not 0 <= value <= MAX_INT or (below is not None and value >= below):
        where = f"in [0, {below})" if below is not None else ">= 0"
        raise Invalid(name, f"must be an int {where}, got {short(value)}")
    return value


def optional_int_field(header: dict[Any, Any], name: str) -> int | None:
    return None if header[name] is None else int_field(header, name)


def bool_field(header: dict[Any, Any], name: str) -> bool:
    value = header[name]
    if type(value) is not bool:
        raise Invalid(name, f"must be a bool, got {short(value)}")
    return value


def ints_field(header: dict[Any, Any], name: str, below: int | None = None) -> tuple[int, ...]:
    values = header[name]
    if type(values) is not list:
        raise Invalid(name, f"must be a list of ints, got {short(values)}")
    for value in values:
        if type(value) is not int or not 0 <= value <= MAX_INT or (below is not None and value >= below):
            where = f"in [0, {below})" if below is not None else ">= 0"
            raise Invalid(name, f"must hold ints {where}, got {short(values)}")
    return tuple(values)


def is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def map_field(header: dict[Any, Any], name: str) -> dict[str, Any]:
    value = header[name]
    if type(value) is not dict or not all(type(key) is str for key in value):
        raise Invalid(name, f"must be a map with string keys, got {short(value)}")
    return value


def dense_groups(
    header: dict[Any, Any], frames: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], trailing: int
) -> tuple[int, ...]:
    """frame_counts: one count per dense buffer, then `trailing` frames; each dense frame 1-D of its dtype."""
    counts = ints_field(header, "frame_counts")
    if len(counts) != len(dtypes) or sum(counts) + trailing != len(frames):
        raise Invalid(
            "frame_counts",
            f"must group {len(frames)} frames into {len(dtypes)} dense buffers and {trailing} more, got {counts}",
        )
    start = 0
    for index, (count, dtype) in enumerate(zip(counts, dtypes, strict=True)):
        for frame in frames[start : start + count]:
            if frame.dtype != dtype or frame.dim() != 1:
                raise Invalid(
                    "frames",
                    f"of buffer {index} must be 1-D {dtype}, got {frame.dtype} shaped {tuple(frame.shape)}",
                )
        start += count
    return counts


def per_part(
    header: dict[Any, Any], name: str, num_parts: int, valid: Callable[[Any], bool]
) -> tuple[dict[str, Any], ...]:
    """A restored PS's per-part maps (empty when fresh): one per dense buffer and table."""
    values = header[name]
    if type(values) is not list or len(values) not in (0, num_parts):
        raise Invalid(name, f"must be a list of {num_parts} maps (or none), got {short(values)}")
    for value in values:
        if type(value) is not dict or not all(type(k) is str and valid(v) for k, v in value.items()):
            raise Invalid(name, f"holds a malformed entry {short(value)}")
    return tuple(values)


def no_frames(frames: Sequence[torch.Tensor]) -> None:
    if frames:
        raise Invalid("frames", f"must be none, got {len(frames)}")
