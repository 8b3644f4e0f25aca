"""Protocol-buffer wire format decoded with numpy over a whole batch at once, for the fast parse_example path.

Every function works on many messages side by side: one numpy step per field, not per message. Anything this
code does not decode the way protobuf would (groups, varints past 64 bits, truncation) raises Irregular, and
the caller parses that batch record by record with protobuf instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]

LENGTH_DELIMITED = 2


class Irregular(Exception):
    """The batch is valid protobuf this module does not decode; protobuf parses it instead."""


@dataclass(frozen=True)
class Fields:
    """The fields of many messages, grouped by message in wire order. For a length-delimited field,
    [start, end) is its payload; for the others, its value's bytes."""

    message: Int64Array  # index of the message each field belongs to
    number: Int64Array
    wire_type: Int64Array
    start: Int64Array
    end: Int64Array

    def select(self, mask: npt.NDArray[np.bool_]) -> Fields:
        return Fields(self.message[mask], self.number[mask], self.wire_type[mask], self.start[mask], self.end[mask])


PADDING = bytes(32)
"""Zero bytes the caller appends to the buffer, so that reads past a message's end stay inside the array; such
reads are then caught by comparing where values end with where their message ends."""


def read_varints(buffer: ByteArray, position: Int64Array) -> tuple[Int64Array, Int64Array]:
    """The varints starting at `position`, as int64 (two's complement), and the positions after them."""
    first = buffer[position]
    if (first < 0x80).all():  # one byte each: tags, and lengths under 128
        return first.astype(np.int64), position + 1
    value = (first & 0x7F).astype(np.uint64)
    position = position + 1
    pending = np.flatnonzero(first >= 0x80)
    for shift in range(7, 70, 7):
        at = position[pending]
        byte = buffer[at]
        value[pending] |= (byte & 0x7F).astype(np.uint64) << np.uint64(shift)
        position[pending] = at + 1
        pending = pending[byte >= 0x80]
        if not pending.size:
            return value.view(np.int64), position
    raise Irregular("a varint longer than 10 bytes")


def single_fields(buffer: ByteArray, start: Int64Array, end: Int64Array) -> Fields | None:
    """When every message is exactly one length-delimited field with a one-byte tag (the common layout), those
    fields, found with a few numpy steps; otherwise None."""
    if (start >= end).any():
        return None
    tag = buffer[start]
    if ((tag & 0x87) != LENGTH_DELIMITED).any():
        return None
    length, payload = read_varints(buffer, start + 1)
    if (payload + length != end).any():
        return None
    number = (tag >> 3).astype(np.int64)
    return Fields(np.arange(start.size), number, np.full(start.size, LENGTH_DELIMITED), payload, end)


def scan_fields(buffer: ByteArray, start: Int64Array, end: Int64Array) -> Fields:
    """Split each message buffer[start[i]:end[i]] into its fields."""
    position = start.copy()
    active = np.flatnonzero(start < end)
    found: list[tuple[Int64Array, ...]] = []
    while active.size:
        at = position[active]
        limit = end[active]
        first = buffer[at]
        if ((first & 0x87) == LENGTH_DELIMITED).all():  # one-byte tags of length-delimited fields
            tag, wire_type = first.astype(np.int64), np.full(at.size, LENGTH_DELIMITED)
            length, value_start = read_varints(buffer, at + 1)
            value_end = value_start + length
        else:
            tag, at = read_varints(buffer, at)
            wire_type = tag & 7
            value_start, value_end = _values(buffer, wire_type, at)
        if (value_end > limit).any() or (value_end < value_start).any():
            raise Irregular("a field runs past the end of its message")
        found.append((active, tag >> 3, wire_type, value_start, value_end))
        position[active] = value_end
        active = active[value_end < limit]
    if not found:
        empty = np.zeros(0, np.int64)
        return Fields(empty, empty, empty, empty, empty)
    if len(found) == 1:
        return Fields(*found[0])
    columns = [np.concatenate(column) for column in zip(*found, strict=True)]
    order = np.argsort(columns[0], kind="stable")  # message-major; wire order kept within a message
    return Fields(*(column[order] for column in columns))


def _values(buffer: ByteArray, wire_type: Int64Array, at: Int64Array) -> tuple[Int64Array, Int64Array]:
    """Where the values after the tags at `at` start and end, for any wire type but groups."""
    if ((wire_type == 3) | (wire_type == 4) | (wire_type > 5)).any():
        raise Irregular("groups or an unknown wire type")
    value_start = at.copy()
    value_end = at + np.where(wire_type == 1, 8, np.where(wire_type == 5, 4, 0))
    varint = wire_type == 0
    if varint.any():
        value_end[varint] = read_varints(buffer, at[varint])[1]
    delimited = wire_type == LENGTH_DELIMITED
    if delimited.any():
        length, payload = read_varints(buffer, at[delimited])
        value_start[delimited] = payload
        value_end[delimited] = payload + length
    return value_start, value_end


def gather(buffer: ByteArray, start: Int64Array, end: Int64Array) -> ByteArray:
    """The bytes of every range [start[i], end[i]) concatenated."""
    lengths = end - start
    if lengths.size and (lengths == lengths[0]).all():
        return buffer[start[:, None] + np.arange(lengths[0])].reshape(-1)
    offsets = np.repeat(start - np.cumsum(lengths) + lengths, lengths)
    return buffer[offsets + np.arange(offsets.size)]


def decode_varint_stream(data: ByteArray) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Every varint in `data` (which must end with a whole one) as int64, and a mask of their last bytes."""
    last = data < 0x80
    if data.size and not last[-1]:
        raise Irregular("packed varints end inside a value")
    ends = np.flatnonzero(last)
    if ends.size == data.size:
        return data.astype(np.int64), last
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if (lengths > 10).any():
        raise Irregular("a varint longer than 10 bytes")
    shifts = (np.arange(data.size) - np.repeat(starts, lengths)) * 7
    parts = (data & 0x7F).astype(np.uint64) << shifts.astype(np.uint64)
    # The parts of one varint occupy disjoint bits, so adding them is or-ing them; overflow past bit 63 wraps
    # the way protobuf truncates.
    return np.add.reduceat(parts, starts).view(np.int64), last
