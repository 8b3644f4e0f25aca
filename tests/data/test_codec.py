"""codec: elements through a buffer and back, with numpy dtypes, bytes, object arrays and namedtuples intact."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

from shardflow.data import codec

Point = collections.namedtuple("Point", "x y")


def round_trip(element: Any) -> Any:
    encoded = codec.encode(element)
    buffer = bytearray(encoded.nbytes + 64)
    codec.write(encoded, memoryview(buffer), 64)
    return codec.decode(encoded.spec, memoryview(buffer), 64)


def test_round_trip_keeps_structure_dtypes_and_values(same_elements: Any) -> None:
    element = {
        "image": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        "label": np.int64(3),
        "weights": np.asfortranarray(np.ones((3, 2), dtype=np.float16)),
        "empty": np.zeros((0, 5), dtype=np.float32),
        "id": b"record-7",
        "tags": np.array([[b"a", b""], [b"ccc", b"dd"]], dtype=object),
        "pair": (np.bool_(True), 2.5),
        "when": np.array(["2024-01-01"], dtype="datetime64[D]"),
    }
    same_elements([round_trip(element)], [element])


def test_namedtuples_come_back_as_their_type() -> None:
    decoded = round_trip(Point(np.int32(1), b"y"))
    assert isinstance(decoded, Point) and decoded.y == b"y"


def test_arbitrary_objects_are_refused() -> None:
    with pytest.raises(TypeError, match="elements must hold numpy arrays, numbers or bytes"):
        codec.encode({"bad": object()})
    with pytest.raises(TypeError, match="object arrays in elements must hold only bytes"):
        codec.encode(np.array([1, "a"], dtype=object))


def test_stacked_elements_unstack_to_equal_elements(same_elements: Any) -> None:
    elements = [{"x": np.arange(3) + index, "y": (np.float32(index), np.int8(-index))} for index in range(4)]
    stacked = codec.stack(elements)
    assert stacked is not None
    assert stacked["x"].shape == (4, 3) and stacked["y"][0].dtype == np.float32
    same_elements(codec.unstack(stacked, 4), elements)


@pytest.mark.parametrize(
    "elements",
    [
        [np.zeros(2), np.zeros(3)],  # shapes differ
        [np.int64(1), np.int32(1)],  # scalar types differ
        [np.array(1.0), np.array(2.0)],  # rank 0: a row would come back as a scalar
        [b"a", b"b"],  # bytes
        [{"a": np.zeros(1)}, {"b": np.zeros(1)}],  # structures differ
        [np.array([b"x"], dtype=object), np.array([b"y"], dtype=object)],
    ],
)
def test_elements_that_would_not_unstack_equal_are_not_stacked(elements: list[Any]) -> None:
    assert codec.stack(elements) is None
