"""Serialized tf.train.Example records to one column of values per feature, for a whole batch.

`decode_columns` tries the layout path first (layout.py: records shaped like a cached sample), then the numpy path
over the concatenated batch (no per-record Python), and falls back to protobuf record by record when the batch holds
an encoding neither covers; all give equal columns, and the fallback is where malformed records are reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from shardflow.data.errors import InvalidArgumentError
from shardflow.data.example import example_pb2
from shardflow.data.example.features import KIND_NAMES, KIND_OF_DTYPE, STRING, Column
from shardflow.data.example.layout import decode_by_layout
from shardflow.data.example.wire import (
    LENGTH_DELIMITED,
    PADDING,
    ByteArray,
    Fields,
    Int64Array,
    Irregular,
    decode_varint_stream,
    gather,
    read_varints,
    scan_fields,
    single_fields,
)


def decode_columns(serialized: Sequence[bytes], dtypes: Mapping[str, np.dtype[Any]]) -> dict[str, Column]:
    """The column of every feature in `dtypes` (name -> float32, int64 or object dtype)."""
    columns = decode_by_layout(serialized, dtypes)
    if columns is not None:
        return columns
    try:
        return _decode_batch(serialized, dtypes)
    except Irregular:
        return _decode_each(serialized, dtypes)


def _decode_batch(serialized: Sequence[bytes], dtypes: Mapping[str, np.dtype[Any]]) -> dict[str, Column]:
    data = b"".join([*serialized, PADDING])
    buffer = np.frombuffer(data, np.uint8)
    lengths = np.fromiter(map(len, serialized), np.int64, count=len(serialized))
    ends = np.cumsum(lengths)
    # Example.features (1) -> Features.feature map entries (1) -> key (1) and Feature value (2).
    features = _numbered(_fields(buffer, ends - lengths, ends), 1)
    entries = _numbered(scan_fields(buffer, features.start, features.end), 1)
    entry_records = features.message[entries.message]
    key_start, key_end, value_start, value_end = _keys_and_values(buffer, entries)
    columns = {}
    for name, dtype in dtypes.items():
        entry = _entries_named(buffer, name.encode(), key_start, key_end, entry_records)
        kind_field = _fields(buffer, value_start[entry], value_end[entry])
        if kind_field.message.size > 1 and (kind_field.message[1:] == kind_field.message[:-1]).any():
            raise Irregular("a Feature with more than one list (protobuf merges them)")
        if ((kind_field.number < 1) | (kind_field.number > 3) | (kind_field.wire_type != LENGTH_DELIMITED)).any():
            raise Irregular("a Feature with an unknown field")
        records = entry_records[entry][kind_field.message]  # a Feature without a list counts as missing
        _check_kinds(name, dtype, records, kind_field.number)
        columns[name] = _decode_lists(buffer, data, dtype, records, kind_field.start, kind_field.end)
    return columns


def _fields(buffer: ByteArray, start: Int64Array, end: Int64Array) -> Fields:
    single = single_fields(buffer, start, end)
    return single if single is not None else scan_fields(buffer, start, end)


def _numbered(fields: Fields, number: int) -> Fields:
    selected = fields.select(fields.number == number)
    if (selected.wire_type != LENGTH_DELIMITED).any():
        raise Irregular(f"field {number} with an unexpected wire type")
    return selected


def _keys_and_values(buffer: ByteArray, entries: Fields) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
    """Where the key and the value of every map entry lie; an entry without one gets an empty one."""
    key_length, key_start = read_varints(buffer, entries.start + 1)
    key_end = key_start + key_length
    if (buffer[entries.start] == 0x0A).all() and (key_end < entries.end).all():
        value_length, value_start = read_varints(buffer, key_end + 1)
        value_end = value_start + value_length
        if (buffer[key_end] == 0x12).all() and (value_end == entries.end).all():
            return key_start, key_end, value_start, value_end  # the layout protobuf writes: key, then value
    fields = scan_fields(buffer, entries.start, entries.end)
    return (*_only_field(fields, 1, entries), *_only_field(fields, 2, entries))


def _only_field(fields: Fields, number: int, entries: Fields) -> tuple[Int64Array, Int64Array]:
    field = _numbered(fields, number)
    if field.message.size > 1 and (field.message[1:] == field.message[:-1]).any():
        raise Irregular("a map entry with a repeated key or value")
    start, end = entries.end.copy(), entries.end.copy()
    start[field.message] = field.start
    end[field.message] = field.end
    return start, end


def _entries_named(
    buffer: ByteArray, name: bytes, key_start: Int64Array, key_end: Int64Array, entry_records: Int64Array
) -> Int64Array:
    """The entries whose key is `name`: the last one of each record, as protobuf's map parsing keeps."""
    entry = np.flatnonzero(key_end - key_start == len(name))
    if name and entry.size:
        key_bytes = buffer[key_start[entry][:, None] + np.arange(len(name))]
        entry = entry[(key_bytes == np.frombuffer(name, np.uint8)).all(axis=1)]
    records = entry_records[entry]
    if records.size > 1 and (records[1:] == records[:-1]).any():
        entry = entry[np.append(records[1:] != records[:-1], True)]
    return entry


def _decode_lists(
    buffer: ByteArray, data: bytes, dtype: np.dtype[Any], records: Int64Array, start: Int64Array, end: Int64Array
) -> Column:
    if dtype == STRING:
        items = _numbered(_fields(buffer, start, end), 1)
        counts = np.bincount(items.message, minlength=records.size).astype(np.int64)
        strings = np.empty(items.start.size, dtype=object)
        strings[:] = [data[a:b] for a, b in zip(items.start.tolist(), items.end.tolist(), strict=True)]
        return Column(records, counts, strings)
    # A float or int64 list is written as one packed field (tag 0x0a, byte length, values), or left empty.
    nonempty = start < end
    if (buffer[start[nonempty]] != 0x0A).any():
        raise Irregular("a list that is not one packed field")
    length, payload = read_varints(buffer, start[nonempty] + 1)
    if (payload + length != end[nonempty]).any():
        raise Irregular("a list that is not one packed field")
    start = start.copy()
    start[nonempty] = payload
    raw = gather(buffer, start, end)
    if dtype.kind == "f":
        if ((end - start) % 4).any():
            raise Irregular("a float list whose length is not a multiple of 4")
        return Column(records, (end - start) // 4, raw.view(np.dtype("<f4")).astype(np.float32, copy=False))
    values, last_bytes = decode_varint_stream(raw)
    bounds = np.cumsum(end - start)
    ends_seen = np.concatenate(([0], np.cumsum(last_bytes)))
    if (end > start).any() and not last_bytes[bounds[end > start] - 1].all():
        raise Irregular("packed varints that run from one list into the next")
    return Column(records, ends_seen[bounds] - ends_seen[bounds - (end - start)], values)


def _decode_each(serialized: Sequence[bytes], dtypes: Mapping[str, np.dtype[Any]]) -> dict[str, Column]:
    """The reference path: protobuf parses every record; also the one that reports malformed records."""
    found: dict[str, tuple[list[int], list[int], list[Any]]] = {name: ([], [], []) for name in dtypes}
    for index, record in enumerate(serialized):
        try:
            feature_map = example_pb2.Example.FromString(record).features.feature
        except DecodeError as error:
            raise InvalidArgumentError(f"record {index} is not a serialized tf.train.Example: {error}") from None
        for name, (records, kinds, lists) in found.items():
            if name in feature_map:
                feature = feature_map[name]
                kind = feature.WhichOneof("kind")
                if kind is not None:
                    records.append(index)
                    kinds.append(feature.DESCRIPTOR.fields_by_name[kind].number)
                    lists.append(getattr(feature, kind).value)
    columns = {}
    for name, (records, kinds, lists) in found.items():
        dtype = dtypes[name]
        record_array = np.array(records, dtype=np.int64)
        _check_kinds(name, dtype, record_array, np.array(kinds, dtype=np.int64))
        counts = np.fromiter(map(len, lists), np.int64, count=len(lists))
        values = np.empty(int(counts.sum()), dtype=dtype)
        values[:] = [value for values_of_record in lists for value in values_of_record]
        columns[name] = Column(record_array, counts, values)
    return columns


def _check_kinds(name: str, dtype: np.dtype[Any], records: Int64Array, kinds: Int64Array) -> None:
    expected = KIND_OF_DTYPE[dtype]
    wrong = np.flatnonzero(kinds != expected)
    if wrong.size:
        raise InvalidArgumentError(
            f"feature {name!r} of record {records[wrong[0]]} holds {KIND_NAMES[int(kinds[wrong[0]])]} values, but "
            f"its spec expects {KIND_NAMES[expected]}"
        )
