"""The layout path of parse_example (records shaped like a cached sample) gives exactly what protobuf gives, and
refuses records that only look like the sample."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.data.example import FixedLenFeature, make_example, parse_example
from shardflow.data.example import layout as layout_module
from shardflow.data.example.decode import _decode_each
from shardflow.data.example.features import FLOAT, INT64, STRING

from .test_fast_path import DTYPES, assert_same_columns, dense, encoded_example

SCHEMA: dict[str, np.dtype[Any]] = {"f": FLOAT, "i": INT64, "s": STRING, "n": INT64}


@pytest.fixture(autouse=True)
def empty_layout_cache():
    """Layouts learned by another test must not decide what this one sees."""
    layout_module._layouts.clear()
    layout_module._plans.clear()
    yield
    layout_module._layouts.clear()
    layout_module._plans.clear()


def decode_twice(records: list[bytes], dtypes: dict) -> None:
    """The layout path, when it decodes the batch (the second time with cached layouts), equals protobuf."""
    expected = _decode_each(records, dtypes)
    for _ in range(2):
        columns = layout_module.decode_by_layout(records, dtypes)
        if columns is not None:
            assert_same_columns(columns, expected)


@settings(max_examples=300, deadline=None)
@given(st.lists(encoded_example(), max_size=6))
def test_any_valid_encoding_is_decoded_as_protobuf_decodes_it_or_left_to_the_other_paths(records):
    with contextlib.suppress(ValueError):  # a feature of the wrong kind: the reference raises, so must parse_example
        decode_twice(records, DTYPES)


# Examples written by one writer from one schema: values vary, so do the lengths of strings and varints.
examples = st.fixed_dictionaries(
    {
        "f": st.lists(st.floats(width=32, allow_nan=False), min_size=3, max_size=3),
        "i": st.lists(st.sampled_from([0, 1, 127, 128, 300, 2**40, -1]), min_size=0, max_size=3),
        "s": st.lists(st.binary(max_size=4), min_size=1, max_size=2),
    },
    optional={"n": st.integers(-5, 500)},
)


@settings(max_examples=200, deadline=None)
@given(st.lists(examples, min_size=1, max_size=40))
def test_batches_of_one_schema_with_varied_values_decode_as_protobuf(features):
    records = [
        make_example(
            {name: np.array(value, dtype=SCHEMA[name]) if name != "n" else value for name, value in example.items()}
        )
        for example in features
    ]
    decode_twice(records, SCHEMA)


def test_a_record_of_the_same_length_with_another_key_is_not_read_with_the_cached_layout():
    features = {"ab": FixedLenFeature((1,), np.int64, default_value=-1), "ba": FixedLenFeature((1,), np.int64, -1)}
    first, second = make_example({"ab": [1]}), make_example({"ba": [2]})
    assert len(first) == len(second)
    assert dense(parse_example([first, first], features), "ab").tolist() == [[1], [1]]
    parsed = parse_example([first, second], features)
    assert dense(parsed, "ab").tolist() == [[1], [-1]] and dense(parsed, "ba").tolist() == [[-1], [2]]


def test_packed_varints_of_the_same_bytes_but_other_boundaries_are_told_apart():
    # [128] takes two bytes (0x80 0x01); [0, 1] takes two bytes too (0x00 0x01), with another boundary.
    first, second = make_example({"i": [128]}), make_example({"i": [0, 1]})
    assert len(first) == len(second)
    parse_example([first], {"i": FixedLenFeature((1,), np.int64)})
    parsed = parse_example([second], {"i": FixedLenFeature((2,), np.int64)})
    assert dense(parsed, "i").tolist() == [[0, 1]]


def test_records_of_the_benchmark_schema_take_the_layout_path():
    records = [
        make_example({"x": np.arange(16, dtype=np.float32) + index, "y": [index % 10], "id": b"user%d" % index})
        for index in range(300)
    ]
    spec = {
        "x": FixedLenFeature((16,), np.float32),
        "y": FixedLenFeature((1,), np.int64),
        "id": FixedLenFeature((), bytes),
    }
    assert layout_module.decode_by_layout(records, {name: f.dtype for name, f in spec.items()}) is not None
    parsed = parse_example(records, spec)
    assert dense(parsed, "x")[299, 15] == 314 and dense(parsed, "y")[:12, 0].tolist() == [*range(10), 0, 1]
    assert dense(parsed, "id")[123] == b"user123"
