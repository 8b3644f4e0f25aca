"""tf.data's API surface, run as the same code on tf.data and on shardflow.data: cardinality and len(), element_spec,
iterators (get_next, get_next_as_optional), errors by their tf.errors names, Options, `name=`, range's output_type,
from_generator's output_types, and tf.data.experimental's functions."""

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
    data: Any  # tf.data or shardflow.data
    errors: Any  # tf.errors or shardflow.data.errors
    TensorSpec: Callable[..., Any]
    int32: Any
    int64: Any
    float32: Any
    string: Any

    @property
    def Dataset(self) -> Any:
        return self.data.Dataset


TF = Lib("tf", tf.data, tf.errors, tf.TensorSpec, tf.int32, tf.int64, tf.float32, tf.string)
SF = Lib("shardflow", data, data.errors, data.TensorSpec, np.int32, np.int64, np.float32, bytes)
Pipeline = Callable[[Lib], Any]


@pytest.fixture(params=[TF, SF], ids=lambda lib: lib.name)
def lib(request: pytest.FixtureRequest) -> Lib:
    return request.param


def both(pipeline: Pipeline) -> tuple[Any, Any]:
    """(shardflow's result, tf's result) of the same pipeline code."""
    return pipeline(SF), pipeline(TF)


def plain(element: Any) -> Any:
    if isinstance(element, dict):
        return {key: plain(value) for key, value in element.items()}
    if isinstance(element, tuple):
        return tuple(plain(item) for item in element)
    return element.numpy() if isinstance(element, tf.Tensor) else element


def spec_summary(spec: Any) -> Any:
    """A spec structure as (shape, dtype name) leaves, comparable between the libraries (strings are "string")."""
    if isinstance(spec, dict):
        return {key: spec_summary(value) for key, value in spec.items()}
    if isinstance(spec, tuple):
        return tuple(spec_summary(item) for item in spec)
    if isinstance(spec, tf.TensorSpec):
        shape = None if spec.shape.rank is None else tuple(spec.shape.as_list())
        return shape, spec.dtype.name
    shape = None if spec.shape is None else tuple(spec.shape)
    return shape, "string" if spec.dtype is bytes else np.dtype(spec.dtype).name


def unknown_count(lib: Lib) -> Any:
    return lib.Dataset.range(10).filter(lambda x: x < 100)


def infinite(lib: Lib) -> Any:
    return lib.Dataset.range(10).repeat()


# Cardinality: tf.data's rule per transformation, over known, infinite and unknown inputs.

CARDINALITY_CASES: dict[str, Pipeline] = {
    "range": lambda lib: lib.Dataset.range(0, 10, 3),
    "range_negative_step": lambda lib: lib.Dataset.range(10, 0, -3),
    "range_empty": lambda lib: lib.Dataset.range(5, 2),
    "from_tensors": lambda lib: lib.Dataset.from_tensors(np.arange(4)),
    "from_tensor_slices": lambda lib: lib.Dataset.from_tensor_slices(np.zeros((7, 2))),
    "map": lambda lib: lib.Dataset.range(10).map(lambda x: x + 1, num_parallel_calls=2),
    "filter": unknown_count,
    "flat_map": lambda lib: lib.Dataset.range(3).flat_map(lambda x: lib.Dataset.range(2)),
    "interleave": lambda lib: lib.Dataset.range(3).interleave(lambda x: lib.Dataset.range(2), cycle_length=2),
    "batch": lambda lib: lib.Dataset.range(10).batch(3),
    "batch_drop_remainder": lambda lib: lib.Dataset.range(10).batch(3, drop_remainder=True),
    "batch_infinite": lambda lib: infinite(lib).batch(3),
    "batch_unknown": lambda lib: unknown_count(lib).batch(3),
    "padded_batch": lambda lib: lib.Dataset.range(10).padded_batch(4),
    "unbatch_of_fixed_rows": lambda lib: lib.Dataset.from_tensors(np.zeros((3, 2))).repeat(2).unbatch(),
    "unbatch_of_drop_remainder": lambda lib: lib.Dataset.range(10).batch(2, drop_remainder=True).unbatch(),
    "unbatch_of_ragged_batches": lambda lib: lib.Dataset.range(10).batch(3).unbatch(),
    "window": lambda lib: lib.Dataset.range(10).window(3),
    "window_drop_remainder": lambda lib: lib.Dataset.range(10).window(3, drop_remainder=True),
    "window_shift_stride": lambda lib: lib.Dataset.range(10).window(3, 1, 2, drop_remainder=True),
    "window_shift": lambda lib: lib.Dataset.range(10).window(3, 4, 2),
    "repeat": lambda lib: lib.Dataset.range(10).repeat(3),
    "repeat_zero": lambda lib: lib.Dataset.range(10).repeat(0),
    "repeat_forever": infinite,
    "repeat_forever_unknown": lambda lib: unknown_count(lib).repeat(),
    "repeat_unknown": lambda lib: unknown_count(lib).repeat(3),
    "repeat_forever_empty": lambda lib: lib.Dataset.range(0).repeat(),
    "take": lambda lib: lib.Dataset.range(10).take(3),
    "take_more": lambda lib: lib.Dataset.range(10).take(20),
    "take_all": lambda lib: lib.Dataset.range(10).take(-1),
    "take_infinite": lambda lib: infinite(lib).take(3),
    "take_zero_unknown": lambda lib: unknown_count(lib).take(0),
    "skip": lambda lib: lib.Dataset.range(10).skip(3),
    "skip_more": lambda lib: lib.Dataset.range(10).skip(20),
    "skip_all": lambda lib: lib.Dataset.range(10).skip(-1),
    "skip_all_infinite": lambda lib: infinite(lib).skip(-1),
    "skip_unknown": lambda lib: unknown_count(lib).skip(0),
    "shard_first": lambda lib: lib.Dataset.range(10).shard(3, 0),
    "shard_last": lambda lib: lib.Dataset.range(10).shard(3, 2),
    "shard_infinite": lambda lib: infinite(lib).shard(3, 1),
    "concatenate": lambda lib: lib.Dataset.range(10).concatenate(lib.Dataset.range(4)),
    "concatenate_unknown_infinite": lambda lib: unknown_count(lib).concatenate(infinite(lib)),
    "concatenate_unknown": lambda lib: lib.Dataset.range(0).concatenate(unknown_count(lib)),
    "zip": lambda lib: lib.Dataset.zip((lib.Dataset.range(10), lib.Dataset.range(3))),
    "zip_infinite": lambda lib: lib.Dataset.zip((lib.Dataset.range(10), infinite(lib))),
    "zip_all_infinite": lambda lib: lib.Dataset.zip((infinite(lib), infinite(lib))),
    "zip_unknown_and_empty": lambda lib: lib.Dataset.zip((unknown_count(lib), lib.Dataset.range(0))),
    "enumerate": lambda lib: lib.Dataset.range(5).enumerate(),
    "shuffle_prefetch_cache": lambda lib: lib.Dataset.range(6).shuffle(3).cache().prefetch(2),
    "with_options": lambda lib: lib.Dataset.range(6).with_options(lib.data.Options()),
    "ignore_errors": lambda lib: lib.Dataset.range(6).ignore_errors(),
    "skip_take_of_infinite": lambda lib: infinite(lib).skip(2).take(4),
    "assert_cardinality": lambda lib: unknown_count(lib).apply(lib.data.experimental.assert_cardinality(10)),
    "list_files": lambda lib: lib.Dataset.list_files(__file__),
    "scan": lambda lib: lib.Dataset.range(10).scan(np.int64(0), lambda total, x: (total + x, total)),
    "take_while": lambda lib: lib.Dataset.range(10).take_while(lambda x: x < 3),
    "unique": lambda lib: lib.Dataset.range(10).unique(),
    "counter": lambda lib: lib.Dataset.counter(),
    "random_take": lambda lib: lib.Dataset.random(seed=1).take(3),
    "sample_infinite_and_finite": lambda lib: lib.Dataset.sample_from_datasets([infinite(lib), lib.Dataset.range(3)]),
    "sample_finite": lambda lib: lib.Dataset.sample_from_datasets([lib.Dataset.range(3), lib.Dataset.range(3)]),
    "choose_infinite_by_finite_choices": lambda lib: lib.Dataset.choose_from_datasets(
        [infinite(lib), infinite(lib)], lib.Dataset.range(2)
    ),
    "group_by_window": lambda lib: lib.Dataset.range(10).group_by_window(
        lambda x: x % 2, lambda key, window: window.batch(2), window_size=2
    ),
}


@pytest.mark.parametrize("pipeline", CARDINALITY_CASES.values(), ids=CARDINALITY_CASES.keys())
def test_cardinality_equals_tf(pipeline: Pipeline) -> None:
    mine, theirs = both(pipeline)
    assert mine.cardinality() == int(theirs.cardinality())


def length_or_error(dataset: Any) -> Any:
    try:
        return len(dataset)
    except TypeError as error:
        return str(error)


@pytest.mark.parametrize(
    "pipeline", [lambda lib: lib.Dataset.range(7).batch(2), infinite, unknown_count], ids=["known", "inf", "unknown"]
)
def test_len_is_the_count_or_a_type_error_as_tf(pipeline: Pipeline) -> None:
    mine, theirs = both(pipeline)
    assert length_or_error(mine) == length_or_error(theirs)
    assert bool(mine) and bool(theirs)


def test_cardinality_constants_equal_tf() -> None:
    assert (data.INFINITE_CARDINALITY, data.UNKNOWN_CARDINALITY) == (tf.data.INFINITE_CARDINALITY, -2)
    experimental = data.experimental
    assert experimental.INFINITE_CARDINALITY == tf.data.experimental.INFINITE_CARDINALITY
    assert experimental.UNKNOWN_CARDINALITY == tf.data.experimental.UNKNOWN_CARDINALITY
    both_counts = both(lambda lib: lib.data.experimental.cardinality(lib.Dataset.range(4).batch(3)))
    assert both_counts[0] == int(both_counts[1]) == 2


# element_spec: from the definition where tf.data has one.


def ragged_rows(lib: Lib) -> Any:
    def rows() -> Any:
        for length in range(1, 4):
            yield np.full(length, length, dtype=np.int64)

    return lib.Dataset.from_generator(rows, output_signature=lib.TensorSpec((None,), lib.int64))


SPEC_CASES: dict[str, Pipeline] = {
    "range": lambda lib: lib.Dataset.range(3),
    "range_int32": lambda lib: lib.Dataset.range(3, output_type=lib.int32),
    "from_tensors_dict": lambda lib: lib.Dataset.from_tensors({"a": np.zeros((2, 3), np.float32), "b": b"x"}),
    "slices_tuple": lambda lib: lib.Dataset.from_tensor_slices((np.zeros((4, 2)), np.array([b"a", b"b", b"c", b"d"]))),
    "batch": lambda lib: lib.Dataset.from_tensor_slices(np.zeros((5, 2), np.float32)).batch(2),
    "batch_drop_remainder": lambda lib: lib.Dataset.range(5).batch(2, drop_remainder=True),
    "padded_batch": lambda lib: ragged_rows(lib).padded_batch(2, padded_shapes=[4]),
    "padded_batch_default": lambda lib: ragged_rows(lib).padded_batch(2, drop_remainder=True),
    "unbatch": lambda lib: lib.Dataset.from_tensors(np.zeros((3, 2), np.int32)).unbatch(),
    "zip_enumerate": lambda lib: lib.Dataset.zip((lib.Dataset.range(2), ragged_rows(lib))).enumerate(),
    "concatenate": lambda lib: lib.Dataset.from_tensors(np.zeros(2)).concatenate(lib.Dataset.from_tensors(np.ones(3))),
    "shape_keeping": lambda lib: ragged_rows(lib).filter(lambda x: True).shuffle(2).take(2).repeat(2).prefetch(1),
    "generator_types": lambda lib: lib.Dataset.from_generator(lambda: iter([[1]]), output_types=lib.int64),
    "generator_types_shapes": lambda lib: lib.Dataset.from_generator(
        lambda: iter([([1], 2.0)]), output_types=(lib.int64, lib.float32), output_shapes=((None,), ())
    ),
    "map_scalar": lambda lib: lib.Dataset.range(3).map(lambda x: x * 2),
    "list_files": lambda lib: lib.Dataset.list_files(__file__),
}


@pytest.mark.parametrize("pipeline", SPEC_CASES.values(), ids=SPEC_CASES.keys())
def test_element_spec_equals_tf(pipeline: Pipeline) -> None:
    mine, theirs = both(pipeline)
    assert spec_summary(mine.element_spec) == spec_summary(theirs.element_spec)


@pytest.mark.parametrize("source", ["TextLineDataset", "TFRecordDataset", "FixedLengthRecordDataset"])
def test_file_sources_have_string_scalar_specs(tmp_path: Path, source: str) -> None:
    path = tmp_path / "lines.txt"
    path.write_bytes(b"a\nb\n")
    args: tuple[Any, ...] = (str(path), 1) if source == "FixedLengthRecordDataset" else (str(path),)
    mine, theirs = both(lambda lib: getattr(lib.data, source)(*args))
    assert spec_summary(mine.element_spec) == spec_summary(theirs.element_spec) == ((), "string")


# Sources' arguments: output_type, output_types and output_shapes, name=.


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda lib: lib.Dataset.range(1, 8, 2, output_type=lib.int32),
        lambda lib: lib.Dataset.range(4, output_type=lib.float32),
        lambda lib: lib.Dataset.from_generator(
            lambda: iter([(1, [2, 3]), (4, [5, 6])]), output_types=(lib.int32, lib.float32), output_shapes=((), (2,))
        ),
        lambda lib: lib.Dataset.from_generator(
            lambda count: iter(range(int(count))), output_types=lib.int64, args=(3,)
        ),
    ],
    ids=["range_int32", "range_float32", "generator_types_shapes", "generator_args"],
)
def test_sources_with_tf_arguments_yield_what_tf_yields(pipeline: Pipeline, same_elements: Any) -> None:
    mine, theirs = both(pipeline)
    same_elements(list(mine), list(theirs.as_numpy_iterator()))


def test_name_is_accepted_by_every_op(same_elements: Any) -> None:
    def pipeline(lib: Lib) -> Any:
        named = {"name": "op"}
        first = lib.Dataset.range(12, **named).map(lambda x: x * 2, **named).filter(lambda x: x % 3 != 0, **named)
        first = first.shuffle(1, **named).take(6, **named).skip(1, **named).repeat(2, **named)
        first = first.cache(**named).shard(1, 0, **named).enumerate(**named).prefetch(1, **named)
        second = lib.Dataset.from_tensor_slices((np.arange(5), np.arange(5)), **named)
        second = second.concatenate(lib.Dataset.from_tensors((np.int64(7), np.int64(8)), **named), **named)
        zipped = lib.Dataset.zip((first, second), **named).batch(2, **named).unbatch(**named)
        batched = (
            zipped.padded_batch(2, **named)
            .rebatch(1, **named)
            .window(2, **named)
            .flat_map(lambda *window: lib.Dataset.zip(window), **named)
        )
        return batched.interleave(lambda *args: lib.Dataset.from_tensors(args), cycle_length=1, **named).with_options(
            lib.data.Options(), **named
        )

    mine, theirs = both(pipeline)
    same_elements(list(mine), list(theirs.as_numpy_iterator()))


# Iterators.


def test_get_next_raises_out_of_range_at_the_end(lib: Lib) -> None:
    iterator = iter(lib.Dataset.range(2))
    assert [int(iterator.get_next()), int(iterator.get_next())] == [0, 1]
    with pytest.raises(lib.errors.OutOfRangeError):
        iterator.get_next()


def test_next_raises_stop_iteration_at_the_end(lib: Lib) -> None:
    iterator = iter(lib.Dataset.range(1))
    next(iterator)
    with pytest.raises(StopIteration):
        next(iterator)


def test_get_next_as_optional_holds_the_element_then_nothing(lib: Lib) -> None:
    iterator = iter(lib.Dataset.from_tensors({"x": np.int64(5)}))
    first = iterator.get_next_as_optional()
    assert bool(first.has_value()) and plain(first.get_value()) == {"x": 5}
    assert spec_summary(first.element_spec) == {"x": ((), "int64")}
    empty = iterator.get_next_as_optional()
    assert not bool(empty.has_value())
    with pytest.raises(lib.errors.InvalidArgumentError):
        empty.get_value()


def test_experimental_get_next_as_optional_equals_the_method(lib: Lib) -> None:
    optional = lib.data.experimental.get_next_as_optional(iter(lib.Dataset.range(3, 5)))
    assert int(optional.get_value()) == 3


# Errors, caught by their tf.errors names.


def write_corrupt_tfrecord(path: Path) -> str:
    path.write_bytes(b"this is not a TFRecord file at all")
    return str(path)


ERROR_CASES: dict[str, tuple[str, Callable[[Lib, Path], Any]]] = {
    "missing_tfrecord": ("NotFoundError", lambda lib, tmp: list(lib.data.TFRecordDataset(str(tmp / "none.tfrecord")))),
    "missing_text": ("NotFoundError", lambda lib, tmp: list(lib.data.TextLineDataset(str(tmp / "none.txt")))),
    "corrupt_tfrecord": (
        "DataLossError",
        lambda lib, tmp: list(lib.data.TFRecordDataset(write_corrupt_tfrecord(tmp / "bad.tfrecord"))),
    ),
    "batch_size_zero": ("InvalidArgumentError", lambda lib, tmp: lib.Dataset.range(3).batch(0)),
    "shuffle_buffer_zero": ("InvalidArgumentError", lambda lib, tmp: lib.Dataset.range(3).shuffle(0)),
    "shard_index_out_of_range": ("InvalidArgumentError", lambda lib, tmp: lib.Dataset.range(3).shard(2, 5)),
    "window_size_zero": ("InvalidArgumentError", lambda lib, tmp: lib.Dataset.range(3).window(0)),
    "range_step_zero": ("InvalidArgumentError", lambda lib, tmp: lib.Dataset.range(0, 3, 0)),
    "batch_of_different_shapes": (
        "InvalidArgumentError",
        lambda lib, tmp: list(ragged_rows(lib).batch(2)),
    ),
    "assert_cardinality_too_few": (
        "FailedPreconditionError",
        lambda lib, tmp: list(lib.Dataset.range(3).apply(lib.data.experimental.assert_cardinality(5))),
    ),
    "assert_cardinality_too_many": (
        "FailedPreconditionError",
        lambda lib, tmp: list(lib.Dataset.range(3).apply(lib.data.experimental.assert_cardinality(2))),
    ),
}


@pytest.mark.parametrize("expected, action", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_errors_have_tf_names(lib: Lib, tmp_path: Path, expected: str, action: Callable[[Lib, Path], Any]) -> None:
    with pytest.raises(getattr(lib.errors, expected)):
        action(lib, tmp_path)


def test_assert_cardinality_passes_a_right_count_through(same_elements: Any) -> None:
    mine, theirs = both(lambda lib: unknown_count(lib).apply(lib.data.experimental.assert_cardinality(10)))
    same_elements(list(mine), list(theirs.as_numpy_iterator()))


# Options.


def test_options_refuse_unknown_attributes(lib: Lib) -> None:
    options = lib.data.Options()
    with pytest.raises(AttributeError):
        options.no_such_option = 1
    with pytest.raises(AttributeError):
        options.threading.no_such_option = 1


def test_options_experimental_names_are_aliases(lib: Lib) -> None:
    options = lib.data.Options()
    options.experimental_deterministic = False
    options.experimental_threading.private_threadpool_size = 3
    assert options.deterministic is False
    assert options.threading.private_threadpool_size == 3


def test_options_tf_sets_are_accepted_and_read_back(lib: Lib) -> None:
    options = lib.data.Options()
    options.experimental_slack = True
    options.experimental_warm_start = True
    options.experimental_symbolic_checkpoint = True
    options.experimental_external_state_policy = lib.data.experimental.ExternalStatePolicy.IGNORE
    options.experimental_optimization.map_parallelization = False
    options.threading.max_intra_op_parallelism = 1
    options.autotune.min_parallelism = 2
    options.experimental_distribute.auto_shard_policy = lib.data.experimental.AutoShardPolicy.DATA
    merged = lib.Dataset.range(2).with_options(options).options()
    assert merged.experimental_slack and merged.experimental_warm_start and merged.experimental_symbolic_checkpoint
    assert merged.experimental_external_state_policy.name == "IGNORE"
    assert merged.experimental_optimization.map_parallelization is False
    assert merged.threading.max_intra_op_parallelism == 1 and merged.autotune.min_parallelism == 2
    assert merged.experimental_distribute.auto_shard_policy.name == "DATA"


def test_options_unset_values_are_none_as_tf() -> None:
    names = ["deterministic", "experimental_slack", "experimental_warm_start", "experimental_external_state_policy"]
    mine, theirs = both(lambda lib: lib.data.Options())
    assert [getattr(mine, name) for name in names] == [getattr(theirs, name) for name in names]
    assert mine.threading.private_threadpool_size == theirs.threading.private_threadpool_size


# tf.data.experimental's functions.


def inverse_failing_on_zero(lib: Lib) -> Callable[[Any], Any]:
    """1 / x, raising InvalidArgumentError for 0 in both libraries (tf.data's from check_numerics)."""
    if lib is TF:
        return lambda x: tf.debugging.check_numerics(1.0 / x, "division by zero")

    def inverse(x: Any) -> Any:
        if x == 0:
            raise data.errors.InvalidArgumentError("division by zero")
        return np.float32(1.0) / x

    return inverse


EXPERIMENTAL_CASES: dict[str, Pipeline] = {
    "ignore_errors": lambda lib: (
        lib.Dataset.from_tensor_slices(np.array([1.0, 0.0, 2.0], np.float32))
        .map(inverse_failing_on_zero(lib))
        .apply(lib.data.experimental.ignore_errors())
    ),
    "enumerate_dataset": lambda lib: lib.Dataset.range(3, 6).apply(lib.data.experimental.enumerate_dataset(10)),
    "unbatch": lambda lib: lib.Dataset.range(5).batch(2).apply(lib.data.experimental.unbatch()),
    "map_and_batch": lambda lib: lib.Dataset.range(7).apply(lib.data.experimental.map_and_batch(lambda x: x * 3, 2)),
    "parallel_interleave": lambda lib: lib.Dataset.range(3).apply(
        lib.data.experimental.parallel_interleave(lambda x: lib.Dataset.range(x, x + 3), cycle_length=2)
    ),
    "from_list": lambda lib: lib.data.experimental.from_list([(1, b"a"), (2, b"b")]),
    "choose_goes_on_past_an_empty_input": lambda lib: lib.data.experimental.choose_from_datasets(
        [lib.Dataset.range(2), lib.Dataset.range(10, 14)], lib.Dataset.from_tensor_slices(np.array([0, 0, 0, 1, 1]))
    ),
    "counter": lambda lib: lib.data.experimental.Counter(5, 2).take(3),
}


def test_experimental_shuffle_and_repeat_yields_every_element_count_times() -> None:
    mine, theirs = both(lambda lib: lib.Dataset.range(5).apply(lib.data.experimental.shuffle_and_repeat(5, 2, seed=3)))
    assert sorted(mine) == sorted(int(x) for x in theirs.as_numpy_iterator()) == sorted([*range(5), *range(5)])


@pytest.mark.parametrize("pipeline", EXPERIMENTAL_CASES.values(), ids=EXPERIMENTAL_CASES.keys())
def test_experimental_functions_equal_tf(pipeline: Pipeline, same_elements: Any) -> None:
    mine, theirs = both(pipeline)
    same_elements(list(mine), list(theirs.as_numpy_iterator()))


def test_experimental_get_single_element_equals_tf() -> None:
    mine, theirs = both(lambda lib: lib.data.experimental.get_single_element(lib.Dataset.range(4, 5)))
    assert mine == theirs.numpy() == 4


@pytest.mark.parametrize("compression_type", [None, "GZIP"])
@pytest.mark.parametrize("writer, reader", [(SF, TF), (TF, SF)], ids=["sf_writes", "tf_writes"])
def test_experimental_tfrecord_writer_writes_a_dataset_the_other_library_reads(
    tmp_path: Path, writer: Lib, reader: Lib, compression_type: str | None
) -> None:
    path = str(tmp_path / "records.tfrecord")
    records = [b"first", b"", b"third record"]
    writer.data.experimental.TFRecordWriter(path, compression_type).write(writer.Dataset.from_tensor_slices(records))
    read = reader.data.TFRecordDataset(path, compression_type=compression_type)
    assert [bytes(record) for record in read.as_numpy_iterator()] == records


def test_experimental_tfrecord_writer_refuses_elements_that_are_not_bytes(lib: Lib, tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        lib.data.experimental.TFRecordWriter(str(tmp_path / "x.tfrecord")).write(lib.Dataset.range(2))


def test_experimental_names_shardflow_supports_exist_in_tf() -> None:
    missing = [name for name in data.experimental.__all__ if not hasattr(tf.data.experimental, name)]
    assert missing == []
