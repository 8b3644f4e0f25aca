"""Element sequences of shardflow.data equal tf.data's: sources, batching, windows, zip and enumerate."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from shardflow import data

Pipeline = Callable[[Any], Any]


def run_both(pipeline: Pipeline) -> tuple[list[Any], list[Any]]:
    """The pipeline built once with shardflow.data.Dataset and once with tf.data.Dataset (same names)."""
    return list(pipeline(data.Dataset)), list(pipeline(tf.data.Dataset).as_numpy_iterator())


def ragged(lib: Any) -> Any:
    """Rows [1], [2, 2], [3, 3, 3], ... of int64, through from_generator (same call in both libraries)."""

    def rows() -> Any:
        for length in range(1, 6):
            yield np.full(length, length, dtype=np.int64)

    spec = tf.TensorSpec((None,), tf.int64) if lib is tf.data.Dataset else data.TensorSpec((None,), np.int64)
    return lib.from_generator(rows, output_signature=spec)


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.range(7),
        lambda D: D.range(2, 17, 3),
        lambda D: D.range(10, 0, -3),
        lambda D: D.range(5, 5),
        lambda D: D.from_tensors({"a": np.arange(3, dtype=np.int32), "b": np.float32(1.5)}),
        lambda D: D.from_tensor_slices(np.arange(12, dtype=np.float32).reshape(4, 3)),
        lambda D: D.from_tensor_slices(
            {"x": np.arange(6, dtype=np.int64).reshape(3, 2), "name": np.array([b"a", b"bb", b"ccc"])}
        ),
        lambda D: D.from_tensor_slices((np.arange(3, dtype=np.int32), {"y": np.array([0.5, 1.5, 2.5])})),
    ],
    ids=[
        "range",
        "range_step",
        "range_negative_step",
        "range_empty",
        "from_tensors",
        "slices",
        "slices_dict",
        "slices_tuple_of_dict",
    ],
)
def test_sources_equal_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("batch_size", [1, 3, 4, 10])
def test_batch_equals_tf(batch_size: int, drop_remainder: bool, same_elements: Any) -> None:
    same_elements(*run_both(lambda D: D.range(10).batch(batch_size, drop_remainder=drop_remainder)))


def test_batch_of_dicts_with_bytes_equals_tf(same_elements: Any) -> None:
    names = np.array([b"a", b"bb", b"ccc", b"d", b"e"])
    same_elements(
        *run_both(lambda D: D.from_tensor_slices({"id": np.arange(5, dtype=np.int32), "name": names}).batch(2))
    )


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: ragged(D).padded_batch(2),
        lambda D: ragged(D).padded_batch(2, drop_remainder=True),
        lambda D: ragged(D).padded_batch(3, padded_shapes=[6], padding_values=np.int64(-1)),
        lambda D: D.zip((ragged(D), D.range(5))).padded_batch(2, padded_shapes=([None], [])),
        lambda D: D.from_tensor_slices(np.array([[b"x"], [b"yy"]])).padded_batch(2, padded_shapes=[3]),
    ],
    ids=["max_shape", "drop_remainder", "fixed_shape_and_value", "tuple", "bytes"],
)
def test_padded_batch_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.range(10).batch(3).unbatch(),
        lambda D: D.from_tensors({"a": np.arange(6).reshape(3, 2), "b": np.array([b"x", b"y", b"z"])}).unbatch(),
        lambda D: D.range(10).batch(4).rebatch(3),
        lambda D: D.range(10).batch(4).rebatch(3, drop_remainder=True),
        lambda D: D.range(10).batch(4).rebatch([2, 3]),
        lambda D: D.range(11).batch(2).rebatch([5, 1], drop_remainder=True),
    ],
    ids=["unbatch", "unbatch_dict", "rebatch", "rebatch_drop", "rebatch_sizes", "rebatch_sizes_drop"],
)
def test_unbatch_and_rebatch_equal_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


@pytest.mark.parametrize(
    ("size", "shift", "stride", "drop_remainder"),
    [(3, None, 1, False), (3, 1, 1, False), (3, 1, 1, True), (2, 3, 2, False), (2, 5, 1, False), (4, 2, 2, True)],
)
def test_window_flat_map_equals_tf(
    size: int, shift: int | None, stride: int, drop_remainder: bool, same_elements: Any
) -> None:
    same_elements(
        *run_both(
            lambda D: (
                D.range(11).window(size, shift, stride, drop_remainder).flat_map(lambda window: window.batch(size))
            )
        )
    )


def test_window_of_tuples_zips_back_equal_to_tf(same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: (
                D.zip((D.range(5), D.range(10, 15))).window(2).flat_map(lambda a, b: D.zip((a.batch(2), b.batch(2))))
            )
        )
    )


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.zip(D.range(3), D.range(10, 15)),
        lambda D: D.zip((D.range(4), D.from_tensor_slices(np.array([b"a", b"b", b"c"])))),
        lambda D: D.zip({"i": D.range(3), "j": D.range(5).batch(2)}),
        lambda D: D.from_tensor_slices(np.array([b"a", b"b", b"c"])).enumerate(),
        lambda D: D.range(4).enumerate(start=5),
    ],
    ids=["zip_args", "zip_tuple", "zip_dict", "enumerate", "enumerate_start"],
)
def test_zip_and_enumerate_equal_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))
