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
