"""The batch (numpy) decoding path gives exactly what protobuf gives, for every encoding protobuf accepts."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.data.example import FixedLenFeature, SparseTensor, make_example, parse_example
from shardflow.data.example.decode import _decode_batch, _decode_each, decode_columns
from shardflow.data.example.features import FLOAT, INT64, STRING
from shardflow.data.example.parse import Parsed
from shardflow.data.example.wire import Irregular

DTYPES: dict[str, np.dtype[Any]] = {"f": FLOAT, "i": INT64, "s": STRING, "longer name é": FLOAT}
KIND = {"f": 2, "i": 3, "s": 1, "longer name é": 2, "other": 3}


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


UNKNOWN_FIELD = varint(15 << 3 | 0) + varint(300)


def encode_list(kind: int, values: list, packed: bool) -> bytes:
    if kind == 1:
        return b"".join(delimited(1, value) for value in values)
    if kind == 2:
        if packed:
            return delimited(1, struct.pack(f"<{len(values)}f", *values)) if values else b""
        return b"".join(varint(1 << 3 | 5) + struct.pack("<f", value) for value in values)
    if packed:
        return delimited(1, b"".join(varint(value) for value in values)) if values else b""
    return b"".join(varint(1 << 3 | 0) + varint(value) for value in values)


values_of_kind: dict[int, st.SearchStrategy[list[Any]]] = {
    1: st.lists(st.binary(max_size=12), max_size=4),
    2: st.lists(st.floats(width=32, allow_nan=False), max_size=40),
    3: st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
}


@st.composite
def encoded_example(draw: st.DrawFn) -> bytes:
    """One Example, written the way protobuf writes it or in another valid way protobuf must read the same."""
    names = draw(st.lists(st.sampled_from(sorted(KIND)), unique=True))
    entries = []
    for name in names:
        kind = KIND[name]
        feature = b""
        if draw(st.integers(0, 9)):  # else a Feature without a list: the feature counts as missing
            feature = delimited(kind, encode_list(kind, draw(values_of_kind[kind]), packed=draw(st.booleans())))
        if draw(st.integers(0, 9)) == 0:
            feature += UNKNOWN_FIELD
        key, value = delimited(1, name.encode()), delimited(2, feature)
        entry = value + key if draw(st.integers(0, 9)) == 0 else key + value
        if draw(st.integers(0, 9)) == 0:  # an earlier entry of the same key, which the later one replaces
            entries.append(delimited(1, key + delimited(2, delimited(3, encode_list(3, [1], True)))))
        entries.append(delimited(1, entry))
    if draw(st.integers(0, 9)) == 0:
        entries.append(UNKNOWN_FIELD)
    cut = draw(st.integers(0, len(entries)))
    if draw(st.integers(0, 9)) == 0:  # Features split over two fields, which protobuf merges
        return delimited(1, b"".join(entries[:cut])) + delimited(1, b"".join(entries[cut:]))
    return delimited(1, b"".join(entries))


def dense(parsed: Parsed, name: str) -> npt.NDArray[Any]:
    value = parsed[name]
    assert not isinstance(value, SparseTensor), name
    return value


def assert_same_columns(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(actual[name].records, expected[name].records, err_msg=name)
        np.testing.assert_array_equal(actual[name].counts, expected[name].counts, err_msg=name)
        assert actual[name].values.dtype == expected[name].values.dtype, name
        if expected[name].values.dtype == STRING:
            assert actual[name].values.tolist() == expected[name].values.tolist(), name
        else:  # NaN equals NaN here
            np.testing.assert_array_equal(actual[name].values, expected[name].values, err_msg=name)


@settings(max_examples=300, deadline=None)
@given(st.lists(encoded_example(), max_size=6))
def test_batch_decoding_equals_protobuf_or_hands_the_batch_to_protobuf(records):
    expected = _decode_each(records, DTYPES)
    with contextlib.suppress(Irregular):  # the batch path may decline, but never differ
        assert_same_columns(_decode_batch(records, DTYPES), expected)
    assert_same_columns(decode_columns(records, DTYPES), expected)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"f": st.lists(st.floats(width=32), max_size=40), "i": values_of_kind[3], "s": values_of_kind[1]}
        ),
        max_size=6,
    )
)
def test_records_written_by_protobuf_never_leave_the_batch_path(features):
    records = [
        make_example({name: np.array(values, dtype=DTYPES[name]) for name, values in example.items()})
        for example in features
    ]
    assert_same_columns(_decode_batch(records, DTYPES), _decode_each(records, DTYPES))


def test_the_batch_path_reads_varints_of_every_length_and_long_lists():
    values = [0, 1, 127, 128, 2**14, 2**35, 2**63 - 1, -1, -(2**63)]
    records = [make_example({"i": values, "f": np.arange(300, dtype=np.float32), "s": [b"x" * 200]})] * 3
    parsed = parse_example(records, {"i": FixedLenFeature((9,), np.int64), "f": FixedLenFeature((300,), np.float32)})
    assert dense(parsed, "i").tolist() == [values] * 3
    assert dense(parsed, "f")[2, 299] == 299
    assert_same_columns(_decode_batch(records, DTYPES), _decode_each(records, DTYPES))
