"""parse_example's fastest path: records laid out like a sample record are decoded with a fixed number of numpy
steps per batch, however many records and layouts it holds.

A layout is learned from one record by a short Python walk and cached by record length. A record of that length
follows it when every byte that steers a protobuf parse (tags, lengths, map keys, and the continuation bits of
packed varints) equals the sample's: protobuf then takes the same path through it, so each feature's values lie
at the same offsets. Records written by one writer from one schema share a few layouts (one per length of their
variable-length values). Anything else goes to decode.py's paths.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data.arrays import distinct
from shardflow.data.example.features import KIND_OF_DTYPE, STRING, Column
from shardflow.data.example.wire import Int64Array, decode_varint_stream, gather

# Layouts kept, by record length (a dataset with more lengths than this uses the other paths), and how many a batch
# may learn before it is handed to them instead.
_MAX_CACHED_LAYOUTS = 256
_MAX_LEARNED_PER_BATCH = 4
# Features in a feature map are field 1 of Example's Features; a map entry is a key (field 1) and a Feature (2),
# whose list is bytes (field 1), float (2) or int64 (3); every list holds its values in field 1.
_TAG_FIELD_1, _TAG_FIELD_2 = 0x0A, 0x12
_KIND_OF_TAG = {0x0A: 1, 0x12: 2, 0x1A: 3}
_BYTES, _FLOAT, _INT64 = 1, 2, 3


class _Unsupported(Exception):
    """The sample record uses an encoding this path does not decode; decode.py's paths take its length."""


@dataclass(frozen=True)
class _Slot:
    """Where one feature's values lie in a record of the layout."""

    kind: int
    start: int  # float and int64: the packed values' bytes, [start, end)
    end: int
    count: int
    strings: tuple[tuple[int, int], ...] = ()  # bytes: [start, end) of each value
    one_byte_varints: bool = True


@dataclass(frozen=True)
class Layout:
    """Which bits of each byte a record must share with the sample (`masks`), their values, and each feature's slot."""

    size: int
    masks: npt.NDArray[np.uint8]
    values: npt.NDArray[np.uint8]
    slots: dict[str, _Slot]


_UNSUPPORTED = Layout(size=-1, masks=np.zeros(0, np.uint8), values=np.zeros(0, np.uint8), slots={})
_layouts: dict[int, Layout] = {}  # by record size
_plans: dict[tuple[int, ...], _Plan] = {}  # by the record sizes of a batch
_layouts_lock = threading.Lock()


class _Walk:
    """Walks one serialized Example the way protobuf parses it, noting each byte that steered the parse."""

    def __init__(self, record: bytes) -> None:
        self.record = record
        self.checked: dict[int, int] = {}  # position -> mask of the bits that must match

    def delimited(self, position: int, end: int, tag: int) -> tuple[int, int]:
        """The payload [start, end) of the length-delimited field with one-byte `tag` at `position`."""
        if position >= end or self.record[position] != tag:
            raise _Unsupported
        self.checked[position] = 0xFF
        length, start = self.varint(position + 1, end, 0xFF)
        if start + length > end:
            raise _Unsupported
        return start, start + length

    def varint(self, position: int, end: int, mask: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if position >= end or shift > 63:
                raise _Unsupported
            byte = self.record[position]
            self.checked[position] = mask
            value |= (byte & 0x7F) << shift
            shift += 7
            position += 1
            if byte < 0x80:
                return value, position

    def example(self) -> dict[str, _Slot]:
        size = len(self.record)
        start, end = self.delimited(0, size, _TAG_FIELD_1)
        if end != size:
            raise _Unsupported  # more than the one Features field
        slots: dict[str, _Slot] = {}
        while start < end:
            entry_start, entry_end = self.delimited(start, end, _TAG_FIELD_1)
            key_start, key_end = self.delimited(entry_start, entry_end, _TAG_FIELD_1)
            self.checked.update(dict.fromkeys(range(key_start, key_end), 0xFF))
            value_start, value_end = self.delimited(key_end, entry_end, _TAG_FIELD_2)
            try:
                key = self.record[key_start:key_end].decode()
            except UnicodeDecodeError:
                raise _Unsupported from None
            if value_end != entry_end or key in slots:
                raise _Unsupported
            slots[key] = self.feature(value_start, value_end)
            start = entry_end
        return slots

    def feature(self, start: int, end: int) -> _Slot:
        if start == end:
            raise _Unsupported  # a Feature without a list
        kind = _KIND_OF_TAG.get(self.record[start])
        if kind is None:
            raise _Unsupported
        list_start, list_end = self.delimited(start, end, self.record[start])
        if list_end != end:
            raise _Unsupported
        if kind == _BYTES:
            strings = []
            while list_start < list_end:
                string = self.delimited(list_start, list_end, _TAG_FIELD_1)
                strings.append(string)
                list_start = string[1]
            return _Slot(kind, 0, 0, len(strings), tuple(strings))
        if list_start == list_end:
            return _Slot(kind, list_start, list_end, 0)
        start, end = self.delimited(list_start, list_end, _TAG_FIELD_1)  # packed values
        if end != list_end:
            raise _Unsupported
        if kind == _FLOAT:
            if (end - start) % 4:
                raise _Unsupported
            return _Slot(kind, start, end, (end - start) // 4)
        count, position, one_byte = 0, start, True
        while position < end:
            _, after = self.varint(position, end, 0x80)
            one_byte &= after == position + 1
            count, position = count + 1, after
        return _Slot(kind, start, end, count, one_byte_varints=one_byte)


def learn_layout(record: bytes) -> Layout | None:
    """The layout of `record`, or None if it uses an encoding this path does not decode."""
    walk = _Walk(record)
    try:
        slots = walk.example()
    except _Unsupported:
        return None
    masks = np.zeros(len(record), dtype=np.uint8)
    masks[list(walk.checked)] = list(walk.checked.values())
    return Layout(size=len(record), masks=masks, values=np.frombuffer(record, np.uint8) & masks, slots=slots)


def decode_by_layout(serialized: Sequence[bytes], dtypes: Mapping[str, np.dtype[Any]]) -> dict[str, Column] | None:
    """decode.py's columns for the batch, or None if a record does not follow a layout cached or learned for it, or
    a feature's kind differs from its dtype (the other paths then report it)."""
    if not serialized:
        return None
    lengths = np.fromiter(map(len, serialized), np.int64, count=len(serialized))
    sizes, which = distinct(lengths)
    plan = _plan_for(serialized, tuple(sizes.tolist()), which)
    if plan is None:
        return None
    # Zeros after the last record, so that every record has `plan.width` bytes from its start.
    data = b"".join([*serialized, bytes(plan.width)])
    starts = np.cumsum(lengths) - lengths
    if not plan.all_follow(data, starts, which):
        return None
    columns: dict[str, Column] = {}
    for name, dtype in dtypes.items():
        feature = plan.feature(name, dtype)
        if feature is None:
            return None
        columns[name] = feature.column(data, starts, which)
    return columns


def _rows(data: bytes, starts: Int64Array, nbytes: int, dtype: str) -> npt.NDArray[Any]:
    """The `nbytes` bytes at each of `starts` as one row of `dtype` values each (read through a strided view, one
    copy per row rather than a gather per byte)."""
    itemsize = np.dtype(dtype).itemsize
    every_start = np.ndarray(
        (len(data) - nbytes + 1, nbytes // itemsize), dtype=dtype, buffer=data, strides=(1, itemsize)
    )
    return every_start[starts]


def _same(values: list[int]) -> int | None:
    """The value if all are equal, else None."""
    return values[0] if values and values.count(values[0]) == len(values) else None


class _FeaturePlan:
    """One feature's slot in each layout of a batch, as arrays indexed by layout, and the constants that spare a
    gather per record when all layouts agree (the usual case)."""

    def __init__(self, slots: list[_Slot | None], dtype: np.dtype[Any]) -> None:
        found = [slot or _Slot(0, 0, 0, 0) for slot in slots]
        present = [slot for slot in slots if slot is not None]
        self.dtype = dtype
        self.present = np.array([slot is not None for slot in slots])
        self.everywhere = len(present) == len(slots)
        self.counts = np.array([slot.count for slot in found], dtype=np.int64)
        self.count = _same([slot.count for slot in present])
        self.start = np.array([slot.start for slot in found], dtype=np.int64)
        self.offset = _same([slot.start for slot in present])
        self.widths = np.array([slot.end - slot.start for slot in found], dtype=np.int64)
        # Numbers are read as rows when every layout has as many bytes of them, none a multi-byte varint.
        self.one_byte_varints = all(slot.one_byte_varints for slot in present)
        self.width = _same([slot.end - slot.start for slot in present]) if self.one_byte_varints else None
        self.bounds = np.array([bound for slot in found for bound in slot.strings], dtype=np.int64).reshape(-1, 2)
        self.first = np.cumsum([0] + [slot.count for slot in found[:-1]])

    def column(self, data: bytes, starts: Int64Array, which: Int64Array) -> Column:
        if self.everywhere:
            records, layout, record_start = np.arange(which.size), which, starts
        else:
            records = np.flatnonzero(self.present[which])
            layout, record_start = which[records], starts[records]
        counts = self.counts[layout] if self.count is None else np.full(records.size, self.count, dtype=np.int64)
        if self.dtype == STRING:
            return Column(records, counts, self._strings(data, layout, record_start, counts))
        begin = record_start + (self.start[layout] if self.offset is None else self.offset)
        return Column(records, counts, self._numbers(data, begin, layout))

    def _numbers(self, data: bytes, begin: Int64Array, layout: Int64Array) -> npt.NDArray[Any]:
        """The float32 or int64 values of every record in order, from the packed bytes at `begin`."""
        float_values = self.dtype.kind == "f"
        if self.width is not None:
            if not self.width or not begin.size:
                return np.zeros(0, dtype=self.dtype)
            if float_values:
                return _rows(data, begin, self.width, "<f4").reshape(-1).astype(np.float32, copy=False)
            return _rows(data, begin, self.width, "u1").reshape(-1).astype(np.int64)
        raw = gather(np.frombuffer(data, np.uint8), begin, begin + self.widths[layout])
        if float_values:
            return raw.view("<f4").astype(np.float32, copy=False)
        return raw.astype(np.int64) if self.one_byte_varints else decode_varint_stream(raw)[0]

    def _strings(
        self, data: bytes, layout: Int64Array, record_start: Int64Array, counts: Int64Array
    ) -> npt.NDArray[Any]:
        """Every bytes value of the records in order, as an object array."""
        if self.count == 1:
            index = self.first[layout]
            record_of_value = record_start
        else:
            total = int(counts.sum())
            offset_in_record = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            index = np.repeat(self.first[layout], counts) + offset_in_record
            record_of_value = np.repeat(record_start, counts)
        begins = (self.bounds[index, 0] + record_of_value).tolist()
        ends = (self.bounds[index, 1] + record_of_value).tolist()
        strings = np.empty(index.size, dtype=object)
        strings[:] = [data[begin:end] for begin, end in zip(begins, ends, strict=True)]
        return strings


class _Plan:
    """What decoding a batch with these layouts needs, built once per set of layouts: the masks and values of all of
    them as rows of 8-byte words, zero-padded to one width, and each feature's slots."""

    def __init__(self, layouts: list[Layout]) -> None:
        self.layouts = layouts
        self.width = -(-max(layout.size for layout in layouts) // 8) * 8
        masks_and_values = np.zeros((len(layouts), 2, self.width), dtype=np.uint8)
        for row, layout in enumerate(layouts):
            masks_and_values[row, 0, : layout.size] = layout.masks
            masks_and_values[row, 1, : layout.size] = layout.values
        self.masks_and_values = masks_and_values.view(np.uint64)
        self._features: dict[tuple[str, np.dtype[Any]], _FeaturePlan | None] = {}

    def all_follow(self, data: bytes, starts: Int64Array, which: Int64Array) -> bool:
        """Whether every record's checked bits equal its layout's. A record that differs teaches its length a new
        layout (from that record) for the batches after this one."""
        records = _rows(data, starts, self.width, "=u8")
        masks_and_values = np.take(self.masks_and_values, which, axis=0)
        np.bitwise_and(records, masks_and_values[:, 0], out=records)
        differs = records != masks_and_values[:, 1]
        if not differs.any():
            return True
        first = int(np.flatnonzero(differs.any(axis=1))[0])
        size = self.layouts[int(which[first])].size
        _remember(data[starts[first] : starts[first] + size])
        return False

    def feature(self, name: str, dtype: np.dtype[Any]) -> _FeaturePlan | None:
        """The feature's slots, or None if a layout holds it with another kind than `dtype`."""
        key = (name, dtype)
        if key not in self._features:
            slots = [layout.slots.get(name) for layout in self.layouts]
            wrong_kind = any(slot is not None and slot.kind != KIND_OF_DTYPE[dtype] for slot in slots)
            self._features[key] = None if wrong_kind else _FeaturePlan(slots, dtype)
        return self._features[key]


def _plan_for(serialized: Sequence[bytes], sizes: tuple[int, ...], which: Int64Array) -> _Plan | None:
    """The plan for the layouts of these record sizes, learning the layouts not cached yet."""
    plan = _plans.get(sizes)
    if plan is not None and all(_layouts.get(size) is layout for size, layout in zip(sizes, plan.layouts, strict=True)):
        return plan
    layouts = []
    learned = 0
    for index, size in enumerate(sizes):
        layout = _layouts.get(size)
        if layout is None:
            if learned == _MAX_LEARNED_PER_BATCH:
                return None
            learned += 1
            layout = _remember(serialized[int(np.argmax(which == index))])
        if layout is _UNSUPPORTED:
            return None
        layouts.append(layout)
    plan = _Plan(layouts)
    with _layouts_lock:
        if len(_plans) >= _MAX_CACHED_LAYOUTS:
            _plans.clear()
        _plans[sizes] = plan
    return plan


def _remember(record: bytes) -> Layout:
    layout = learn_layout(record) or _UNSUPPORTED
    with _layouts_lock:
        if len(_layouts) >= _MAX_CACHED_LAYOUTS:
            _layouts.clear()
        _layouts[len(record)] = layout
    return layout
