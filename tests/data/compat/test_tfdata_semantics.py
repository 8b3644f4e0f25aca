"""tf.data's rules for what an element is, run as the same pipeline on tf.data and on shardflow.data: a list returned
by map is a tuple, Python numbers are int32 and float32, dicts keep their key order, sparse features batch; and
the arguments tf.data accepts or refuses (negative counts, concatenate, padding values, datasets of datasets)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from shardflow import data


@dataclasses.dataclass(frozen=True)
class Lib:
    """The names a pipeline uses, from one library."""

    name: str
    Dataset: Any
    TextLineDataset: Any
    decode_csv: Callable[..., Any]
    parse_example: Callable[..., Any]
    parse_single_example: Callable[..., Any]
    VarLenFeature: Any
    FixedLenFeature: Any


TF = Lib(
    "tf",
    tf.data.Dataset,
    tf.data.TextLineDataset,
    tf.io.decode_csv,
    tf.io.parse_example,
    tf.io.parse_single_example,
    tf.io.VarLenFeature,
    tf.io.FixedLenFeature,
)
SF = Lib(
    "shardflow",
    data.Dataset,
    data.TextLineDataset,
    data.decode_csv,
    data.parse_example,
    data.parse_single_example,
    data.VarLenFeature,
    data.FixedLenFeature,
)
Pipeline = Callable[[Lib], Any]


@pytest.fixture(params=[TF, SF], ids=lambda lib: lib.name)
def lib(request: pytest.FixtureRequest) -> Lib:
    return request.param


def plain(element: Any) -> Any:
    """An element iterated directly (tf tensors or numpy), as numpy, sparse tensors as (indices, values, shape)."""
    if isinstance(element, dict):
        return {key: plain(value) for key, value in element.items()}
    if isinstance(element, tuple):
        return tuple(plain(item) for item in element)
    if hasattr(element, "dense_shape"):
        return tuple(np.asarray(part) for part in (element.indices, element.values, element.dense_shape))
    return element.numpy() if isinstance(element, tf.Tensor) else element


def key_orders(element: Any) -> Any:
    """The keys of every dict in an element, in their order."""
    if isinstance(element, dict):
        return [(key, key_orders(value)) for key, value in element.items()]
    if isinstance(element, tuple):
        return [key_orders(item) for item in element]
    return None


def assert_same_as_tf(pipeline: Pipeline, same_elements: Any) -> None:
    """Elements equal (structure, dict key order, shape, dtype, values) from both libraries."""
    expected = list(pipeline(TF).as_numpy_iterator())
    actual = list(pipeline(SF).as_numpy_iterator())
    same_elements(actual, expected)
    assert [key_orders(element) for element in actual] == [key_orders(element) for element in expected]


def csv_file(tmp_path: Path) -> str:
    path = tmp_path / "rows.csv"
    path.write_bytes(b"1,apple,0.5\n2,banana,1.5\n3,cherry,2.5\n")
    return str(path)


# map: what the function returns


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda lib: lib.Dataset.range(3).map(lambda x: [x, x * 2]),
        lambda lib: lib.Dataset.range(3).map(lambda x: [x, x * 2]).batch(2),
        lambda lib: lib.Dataset.range(2).map(lambda x: (x, [x, x + 1])),
        lambda lib: lib.Dataset.range(2).map(lambda x: {"pair": [x, x]}),
        lambda lib: lib.Dataset.range(2).map(lambda x: [x]),
    ],
    ids=["list_is_tuple", "list_batched", "inner_list_is_array", "list_in_dict_is_array", "one_item_list"],
)
def test_map_returning_a_list_makes_a_tuple_as_tf(pipeline: Pipeline, same_elements: Any) -> None:
    assert_same_as_tf(pipeline, same_elements)


def test_decode_csv_lines_batched_with_mixed_columns_equal_tf(tmp_path: Path, same_elements: Any) -> None:
    name = csv_file(tmp_path)
    defaults = [[0], [""], [0.0]]
    assert_same_as_tf(
        lambda lib: lib.TextLineDataset(name).map(lambda line: lib.decode_csv(line, defaults)).batch(2), same_elements
    )


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda lib: lib.Dataset.range(2).map(lambda x: 1),
        lambda lib: lib.Dataset.range(2).map(lambda x: (1.5, True, 2**40, -(2**31))),
        lambda lib: lib.Dataset.range(2).map(lambda x: {"ints": [1, 2], "floats": [1, 2.5], "nested": [[1.0], [2.0]]}),
        lambda lib: lib.Dataset.range(2).map(lambda x: (np.float64(0.5), np.arange(3), np.int16(4))),
        lambda lib: lib.Dataset.range(2).map(lambda x: (x, 0.5)).batch(2),
        lambda lib: lib.Dataset.from_tensors((1, 2.5, [1, 2], [1.5, 2], "s", b"b", False, 2**33)),
        lambda lib: lib.Dataset.from_tensors({"numpy": np.float64(3.0), "array": np.arange(2, dtype=np.int64)}),
        lambda lib: lib.Dataset.from_tensor_slices([1, 2, 3]),
        lambda lib: lib.Dataset.from_tensor_slices(([1.0, 2.0], [[1, 2], [3, 4]], ["a", "b"])),
        lambda lib: lib.Dataset.from_tensor_slices([(1, 2), (3, 4)]),
        lambda lib: lib.Dataset.from_tensor_slices([2**40, 1]),
        lambda lib: lib.Dataset.from_tensor_slices(np.array([1.0, 2.0])),
    ],
    ids=[
        "map_int",
        "map_float_bool_big_int",
        "map_lists_of_numbers",
        "map_numpy_keeps_dtype",
        "map_float_batched",
        "from_tensors_literals",
        "from_tensors_numpy",
        "slices_int_list",
        "slices_float_int_str_lists",
        "slices_list_of_tuples",
        "slices_big_int",
        "slices_numpy",
    ],
)
def test_python_numbers_convert_to_int32_and_float32_as_tf(pipeline: Pipeline, same_elements: Any) -> None:
    assert_same_as_tf(pipeline, same_elements)


# dicts keep their key order


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda lib: lib.Dataset.from_tensors({"b": 1, "a": 2, "c": {"z": 3, "y": 4}}),
        lambda lib: lib.Dataset.from_tensor_slices({"zeta": [1, 2], "alpha": [3, 4]}).batch(2),
        lambda lib: lib.Dataset.range(3).map(lambda x: {"label": x, "feature": x * 2}),
        lambda lib: lib.Dataset.zip({"second": lib.Dataset.range(2), "first": lib.Dataset.range(2)}),
        lambda lib: lib.Dataset.from_tensors({"y": np.arange(2), "x": np.arange(3)}).padded_batch(1),
        lambda lib: lib.Dataset.from_tensors({"b": 1, "a": 2}).concatenate(lib.Dataset.from_tensors({"a": 3, "b": 4})),
    ],
    ids=["from_tensors", "slices_batched", "map", "zip", "padded_batch", "concatenate_keeps_first_order"],
)
def test_dicts_keep_their_key_order_as_tf(pipeline: Pipeline, same_elements: Any) -> None:
    assert_same_as_tf(pipeline, same_elements)


# take and skip


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda lib: lib.Dataset.range(5).take(-2),
        lambda lib: lib.Dataset.range(5).skip(-2),
        lambda lib: lib.Dataset.range(5).skip(-1),
        lambda lib: lib.Dataset.range(5).take(np.int64(-7)),
        lambda lib: lib.Dataset.range(5).skip(7),
        lambda lib: lib.Dataset.range(3).repeat(-3).take(7),
    ],
    ids=["take_minus_two", "skip_minus_two", "skip_minus_one", "take_numpy_negative", "skip_past_end", "repeat_neg"],
)
def test_negative_counts_mean_all_as_tf(pipeline: Pipeline, same_elements: Any) -> None:
    assert_same_as_tf(pipeline, same_elements)


# concatenate


@pytest.mark.parametrize(
    "other",
    [
        lambda lib: lib.Dataset.from_tensors(np.int32(1)),
        lambda lib: lib.Dataset.from_tensors((np.int64(1), np.int64(2))),
        lambda lib: lib.Dataset.from_tensors(np.float64(1.0)),
        lambda lib: lib.Dataset.from_tensors({"a": np.int64(1)}),
        lambda lib: lib.Dataset.from_tensors(b"text"),
    ],
    ids=["int32_after_int64", "tuple_after_scalar", "float_after_int", "dict_after_scalar", "bytes_after_int"],
)
def test_concatenate_of_different_dtypes_or_structures_raises_type_error(lib: Lib, other: Pipeline) -> None:
    with pytest.raises(TypeError):
        lib.Dataset.range(2).concatenate(other(lib))


def test_concatenate_of_mapped_datasets_of_different_dtypes_raises_type_error(lib: Lib) -> None:
    # shardflow cannot trace a map function, so it finds the difference on the first elements.
    with pytest.raises(TypeError):
        mapped = lib.Dataset.range(2).map(lambda x: x)
        list(mapped.concatenate(lib.Dataset.range(2).map(lambda x: (x, x))).as_numpy_iterator())


def test_concatenate_of_dicts_with_different_keys_raises_type_error(lib: Lib) -> None:
    first = lib.Dataset.from_tensors({"a": np.int64(1)})
    with pytest.raises(TypeError):
        first.concatenate(lib.Dataset.from_tensors({"b": np.int64(1)}))


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda lib: lib.Dataset.from_tensors(np.zeros(2)).concatenate(lib.Dataset.from_tensors(np.ones(3))),
        lambda lib: lib.Dataset.range(2).map(lambda x: (x, x)).concatenate(lib.Dataset.range(2).map(lambda x: [x, x])),
    ],
    ids=["different_shapes", "tuple_then_list"],
)
def test_concatenate_of_compatible_elements_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    assert_same_as_tf(pipeline, same_elements)


# padded_batch


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda lib: lib.Dataset.from_tensor_slices(np.array([[b"a"], [b"b"]])).padded_batch(2, padded_shapes=[3]),
        lambda lib: lib.Dataset.from_tensor_slices(np.array([[b"a"], [b"b"]])).padded_batch(
            2, padded_shapes=[3], padding_values="<pad>"
        ),
        lambda lib: lib.Dataset.from_tensors((np.array([1.0], np.float32), np.array([b"x"]))).padded_batch(
            1, padded_shapes=([2], [2]), padding_values=(-1.0, b"?")
        ),
        lambda lib: lib.Dataset.from_tensors(np.array([3], np.int32)).padded_batch(
            1, padded_shapes=[3], padding_values=-1
        ),
    ],
    ids=["bytes_default", "str_value_is_bytes", "float32_and_bytes_values", "int_value_for_int32"],
)
def test_padded_batch_values_equal_tf(pipeline: Pipeline, same_elements: Any) -> None:
    assert_same_as_tf(pipeline, same_elements)


@pytest.mark.parametrize(
    ("component", "padding_value"),
    [
        (np.array([1, 2], np.int64), 1.5),
        (np.array([1, 2], np.int64), 7),
        (np.array([1, 2], np.int64), np.int32(7)),
        (np.array([1.0], np.float32), 7),
        (np.array([1.0], np.float64), 0.5),
        (np.array([b"x"]), 0),
    ],
    ids=["float_for_int64", "int_for_int64", "int32_for_int64", "int_for_float32", "float_for_float64", "int_for_str"],
)
def test_padded_batch_refuses_a_padding_value_of_another_dtype(lib: Lib, component: Any, padding_value: Any) -> None:
    with pytest.raises(TypeError):
        batched = lib.Dataset.from_tensors(component).padded_batch(2, padded_shapes=[3], padding_values=padding_value)
        list(batched.as_numpy_iterator())


# window after ignore_errors


def test_window_after_ignore_errors_equals_tf(same_elements: Any) -> None:
    lines = ["1", "2", "x", "4", "5", "y", "7"]
    assert_same_as_tf(
        lambda lib: (
            lib.Dataset.from_tensor_slices(lines)
            .map(lambda line: lib.decode_csv(line, [[0]]))
            .ignore_errors()
            .window(2)
            .flat_map(lambda column: column.batch(2))
        ),
        same_elements,
    )


# list_files


def test_list_files_with_several_patterns_sorts_across_them_as_tf(tmp_path: Path, same_elements: Any) -> None:
    for name in ["b1.txt", "a2.txt", "c1.txt", "a1.csv"]:
        (tmp_path / name).touch()
    patterns = [str(tmp_path / "*1.txt"), str(tmp_path / "a*"), str(tmp_path / "b*")]
    assert_same_as_tf(lambda lib: lib.Dataset.list_files(patterns, shuffle=False), same_elements)


# as_numpy_iterator


def test_as_numpy_iterator_over_datasets_raises_type_error(lib: Lib) -> None:
    with pytest.raises(TypeError):
        list(lib.Dataset.range(3).window(2).as_numpy_iterator())


# sparse features


def example_records() -> list[bytes]:
    def example(values: list[int]) -> bytes:
        feature = {
            "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=values)),
            "label": tf.train.Feature(float_list=tf.train.FloatList(value=[len(values) / 2])),
        }
        return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()

    return [example(values) for values in ([3, 1], [], [7, 8, 9], [5])]


def features(lib: Lib) -> dict[str, Any]:
    return {
        "ids": lib.VarLenFeature(tf.int64 if lib is TF else np.int64),
        "label": lib.FixedLenFeature([], tf.float32 if lib is TF else np.float32),
    }


SPARSE_PIPELINES: list[Pipeline] = [
    lambda lib: (
        lib.Dataset.from_tensor_slices(example_records())
        .batch(3)
        .map(lambda batch: lib.parse_example(batch, features(lib)))
    ),
    lambda lib: lib.Dataset.from_tensor_slices(example_records()).map(
        lambda record: lib.parse_single_example(record, features(lib))
    ),
    lambda lib: (
        lib.Dataset.from_tensor_slices(example_records())
        .map(lambda record: lib.parse_single_example(record, features(lib)))
        .batch(3)
    ),
    lambda lib: (
        lib.Dataset.from_tensor_slices(example_records())
        .batch(2)
        .map(lambda batch: lib.parse_example(batch, features(lib)))
        .batch(2)
    ),
    lambda lib: (
        lib.Dataset.from_tensor_slices(example_records())
        .batch(3)
        .map(lambda batch: lib.parse_example(batch, features(lib)))
        .unbatch()
    ),
]
SPARSE_IDS = [
    "parse_batches",
    "parse_records",
    "parse_records_then_batch",
    "parse_batches_then_batch",
    "parse_batches_then_unbatch",
]


@pytest.mark.parametrize("pipeline", SPARSE_PIPELINES, ids=SPARSE_IDS)
def test_var_len_features_as_numpy_are_dense_as_tf(pipeline: Pipeline, same_elements: Any) -> None:
    assert_same_as_tf(pipeline, same_elements)


@pytest.mark.parametrize("pipeline", SPARSE_PIPELINES, ids=SPARSE_IDS)
def test_var_len_features_iterated_directly_are_sparse_as_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements([plain(element) for element in pipeline(SF)], [plain(element) for element in pipeline(TF)])
