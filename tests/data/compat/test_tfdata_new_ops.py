"""tf.data 2.21 as the oracle for sampling, grouping, scan, reduce, unique, take_while, counter, random, resampling,
sparse_batch, save/load, snapshot and fingerprint: the same pipeline code runs on both libraries.

Where tf.data draws random numbers the streams cannot be equal, so those tests check on both libraries the
guarantees tf.data documents: which elements come out, in which proportions, and when a seed repeats them."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from shardflow import data

Pipeline = Callable[[Any], Any]
TF = tf.data.Dataset
SF = data.Dataset


def run_both(pipeline: Pipeline) -> tuple[list[Any], list[Any]]:
    """The pipeline built once with shardflow.data.Dataset and once with tf.data.Dataset (same names)."""
    return list(pipeline(SF)), list(pipeline(TF).as_numpy_iterator())


def elements(dataset: Any) -> list[Any]:
    return list(dataset.as_numpy_iterator())


def scalars(dataset: Any) -> list[int]:
    return [int(value) for value in dataset.as_numpy_iterator()]


def raises_on_iteration(lib: Any, pipeline: Pipeline) -> bool:
    """Whether building and iterating the pipeline raises a user error (tf.data raises some at iteration)."""
    try:
        elements(pipeline(lib))
    except (ValueError, TypeError, tf.errors.InvalidArgumentError, tf.errors.DataLossError, tf.errors.InternalError):
        return True
    return False


@pytest.fixture(params=["tensorflow", "shardflow"])
def lib(request: pytest.FixtureRequest) -> Any:
    return TF if request.param == "tensorflow" else SF


def ints(values: list[Any]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def ragged(lib: Any, lengths: list[int]) -> Any:
    """Rows np.full(n, n) of int64 for n in `lengths`, through from_generator (same call in both libraries)."""

    def rows() -> Any:
        for length in lengths:
            yield np.full(length, length, dtype=np.int64)

    spec = tf.TensorSpec((None,), tf.int64) if lib is TF else data.TensorSpec((None,), np.int64)
    return lib.from_generator(rows, output_signature=spec)


def length_func(lib: Any) -> Callable[..., Any]:
    """The first dimension's size as int32, which bucket_by_sequence_length compares with its boundaries."""
    if lib is TF:
        return lambda row, *_: tf.shape(row)[0]
    return lambda row, *_: np.int32(len(row))


# choose_from_datasets: the order is given, so element sequences must be equal.


@pytest.mark.parametrize("stop_on_empty_dataset", [True, False])
@pytest.mark.parametrize("choices", [[0, 1, 2, 0, 1, 2], [2, 2, 2, 2, 2, 0], [0, 0, 0, 0, 1, 1, 1, 1, 2], []], ids=str)
def test_choose_from_datasets_equals_tf(choices: list[int], stop_on_empty_dataset: bool, same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: D.choose_from_datasets(
                [D.range(3), D.range(10, 12), D.range(20, 24)],
                D.from_tensor_slices(ints(choices)) if choices else D.range(0),
                stop_on_empty_dataset=stop_on_empty_dataset,
            )
        )
    )


def test_choose_from_datasets_of_dicts_equals_tf(same_elements: Any) -> None:
    def pipeline(D: Any) -> Any:
        left = D.from_tensor_slices({"id": ints([1, 2, 3]), "name": np.array([b"a", b"b", b"c"])})
        right = D.from_tensor_slices({"id": ints([7, 8]), "name": np.array([b"x", b"y"])})
        return D.choose_from_datasets([left, right], D.range(2).repeat(3))

    same_elements(*run_both(pipeline))


def test_choose_from_datasets_of_windows_equals_tf(same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: D.choose_from_datasets(
                [D.range(10).window(2), D.range(10, 20).window(2)], D.range(2).repeat(5)
            ).flat_map(lambda window: window)
        )
    )


def test_choose_from_datasets_rejects_a_choice_out_of_range(lib: Any) -> None:
    assert raises_on_iteration(
        lib, lambda D: D.choose_from_datasets([D.range(2), D.range(2)], D.from_tensors(ints([2])[0]))
    )


@pytest.mark.parametrize("choices", [np.array([0, 1], dtype=np.int32), np.array([0.0, 1.0])], ids=["int32", "float"])
def test_choose_from_datasets_rejects_choices_that_are_not_int64(lib: Any, choices: np.ndarray) -> None:
    assert raises_on_iteration(
        lib, lambda D: D.choose_from_datasets([D.range(2), D.range(2)], D.from_tensor_slices(choices))
    )


# sample_from_datasets: tf.data's documented guarantees, checked on both libraries.


def weights_as(kind: str, weights: list[float], lib: Any) -> Any:
    return lib.from_tensors(np.array(weights)).repeat() if kind == "dataset" else weights


@pytest.mark.parametrize("kind", ["list", "dataset"])
@pytest.mark.parametrize("weights", [[0.85, 0.05, 0.1], [0.2, 0.3, 0.5], [1.0]], ids=str)
def test_sample_from_datasets_follows_the_weights(lib: Any, kind: str, weights: list[float]) -> None:
    num_samples = 2000
    datasets = [lib.from_tensors(np.int64(index)).repeat() for index in range(len(weights))]
    sampled = lib.sample_from_datasets(datasets, weights_as(kind, weights, lib), seed=7).take(num_samples)
    frequencies = np.bincount(scalars(sampled), minlength=len(weights)) / num_samples
    chi2 = np.sum((frequencies - weights) ** 2 / np.asarray(weights))
    assert chi2 < 1e-2


@pytest.mark.parametrize("seed", [None, 3])
def test_sample_from_datasets_yields_every_element_once(lib: Any, seed: int | None) -> None:
    datasets = [lib.range(0, 40), lib.range(100, 105), lib.range(200, 260)]
    assert sorted(scalars(lib.sample_from_datasets(datasets, [0.2, 0.3, 0.5], seed=seed))) == [
        *range(0, 40),
        *range(100, 105),
        *range(200, 260),
    ]


def test_sample_from_datasets_keeps_each_input_in_order(lib: Any) -> None:
    sampled = scalars(lib.sample_from_datasets([lib.range(0, 50), lib.range(100, 150)], seed=1))
    assert [value for value in sampled if value < 100] == list(range(50))
    assert [value for value in sampled if value >= 100] == list(range(100, 150))


@pytest.mark.parametrize("kind", ["list", "dataset"])
def test_sample_from_datasets_stops_when_an_input_is_empty(lib: Any, kind: str) -> None:
    datasets = [lib.from_tensors(np.int64(-1)), lib.from_tensors(np.int64(1)).repeat(), lib.range(10).repeat()]
    sampled = lib.sample_from_datasets(datasets, weights_as(kind, [0.5, 0.1, 0.4], lib), stop_on_empty_dataset=True)
    assert scalars(sampled).count(-1) == 1


@pytest.mark.parametrize("kind", ["list", "dataset"])
def test_sample_from_datasets_skips_an_empty_input(lib: Any, kind: str) -> None:
    datasets = [lib.from_tensors(np.int64(-1)), lib.from_tensors(np.int64(1)).repeat(), lib.range(10).repeat()]
    sampled = lib.sample_from_datasets(datasets, weights_as(kind, [0.5, 0.1, 0.4], lib), stop_on_empty_dataset=False)
    values = scalars(sampled.take(100))
    assert len(values) == 100 and values.count(-1) == 1


@pytest.mark.parametrize(
    ("weights", "stop_on_empty_dataset", "expected"),
    [
        ([0.0, 1.0], True, [1, 1]),  # the zero-weight input is never drawn
        ([0.0, 1.0], False, [1, 1]),
        ([0.0, 0.0], False, []),
    ],
)
def test_sample_from_datasets_never_draws_a_zero_weight(
    lib: Any, weights: list[float], stop_on_empty_dataset: bool, expected: list[int]
) -> None:
    datasets = [lib.from_tensors(np.int64(-1)).repeat(), lib.from_tensors(np.int64(1)).repeat(2)]
    sampled = lib.sample_from_datasets(datasets, weights, seed=4, stop_on_empty_dataset=stop_on_empty_dataset)
    assert scalars(sampled) == expected


def test_sample_from_an_empty_input_with_stop_is_empty(lib: Any) -> None:
    sampled = lib.sample_from_datasets(
        [lib.range(0), lib.range(1).repeat()], [1.0, 0.0], seed=1, stop_on_empty_dataset=True
    )
    assert scalars(sampled) == []


@pytest.mark.parametrize("rerandomize", [None, False, True])
def test_sample_from_datasets_rerandomizes_each_iteration_only_when_asked(lib: Any, rerandomize: bool | None) -> None:
    sampled = lib.sample_from_datasets(
        [lib.range(0, 10), lib.range(100, 110)],
        weights=[0.5, 0.5],
        seed=42,
        stop_on_empty_dataset=True,
        rerandomize_each_iteration=rerandomize,
    )
    first, second = scalars(sampled), scalars(sampled)
    epochs = scalars(sampled.repeat(2))
    half = len(epochs) // 2
    assert (first != second) == bool(rerandomize)
    assert (epochs[:half] != epochs[half:]) == bool(rerandomize)


def test_sample_from_datasets_with_the_same_seed_repeats(lib: Any) -> None:
    def make() -> Any:
        return lib.sample_from_datasets([lib.range(0, 30), lib.range(100, 130)], [0.3, 0.7], seed=11)

    assert scalars(make()) == scalars(make())


def test_sample_from_datasets_rejects_bad_arguments(lib: Any) -> None:
    with pytest.raises(ValueError, match=r"same length|one weight per dataset"):
        lib.sample_from_datasets([lib.range(10), lib.range(20)], weights=[0.25, 0.25, 0.5])
    with pytest.raises(ValueError, match="empty"):
        lib.sample_from_datasets([])


# group_by_window and bucket_by_sequence_length.


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.range(10).group_by_window(lambda x: x % 3, lambda key, window: window.batch(10), window_size=2),
        lambda D: D.from_tensor_slices(ints([0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0])).group_by_window(
            lambda x: x % 2, lambda key, window: window.batch(4), window_size=4
        ),
        lambda D: (
            D.from_tensor_slices(ints([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 0, 0, 2, 2, 0, 0]))
            .repeat()
            .group_by_window(lambda x: x % 3, lambda key, window: window.batch(4), window_size=4)
            .take(12)
        ),
        lambda D: D.from_tensor_slices(ints([7, -3, 100, -50, 2, 1 << 40, 70000])).group_by_window(
            lambda x: x, lambda key, window: window.batch(10), window_size=5
        ),
        lambda D: D.range(20).group_by_window(
            lambda x: x % 2, lambda key, window: window.batch(20), window_size_func=lambda key: key * 5 + 5
        ),
        lambda D: D.range(10).group_by_window(
            lambda x: x % 3,
            lambda key, window: window.map(lambda x: (key, x)).batch(10),
            window_size_func=lambda key: key + 1,
        ),
        lambda D: D.range(10).group_by_window(lambda x: x, lambda key, window: window.batch(1), window_size=1),
        lambda D: D.range(9).group_by_window(lambda x: x % 2, lambda key, window: window.skip(1), window_size=3),
        lambda D: (
            D.range(12)
            .map(lambda x: {"x": x, "y": x * 10})
            .filter(lambda d: d["x"] % 2 == 0)
            .group_by_window(lambda d: d["x"] % 4, lambda key, window: window.batch(2), window_size=2)
        ),
        lambda D: (
            D.range(8)
            .map(lambda x: (x, x * 2))
            .group_by_window(lambda x, y: x % 2, lambda key, window: window.batch(3), window_size=3)
        ),
    ],
    ids=[
        "flush_in_key_order",
        "small_groups",
        "immediate_output_of_an_endless_input",
        "negative_and_large_keys",
        "window_size_func",
        "key_in_reduce_func",
        "window_of_one",
        "reduce_drops_elements",
        "dicts_after_filter",
        "tuple_elements_unpacked_into_key_func",
    ],
)
def test_group_by_window_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


def test_group_by_window_reduce_func_can_read_the_window_twice(same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: D.range(12).group_by_window(
                lambda x: x % 3,
                lambda key, window: D.zip((window.batch(4), window.map(lambda x: x * 2).batch(4))),
                window_size=4,
            )
        )
    )


def test_group_by_window_rejects_a_window_size_of_zero(lib: Any) -> None:
    assert raises_on_iteration(
        lib, lambda D: D.range(4).group_by_window(lambda x: x * 0, lambda key, window: window, window_size=0)
    )


LENGTHS = [1, 5, 3, 2, 7, 4, 6, 1, 9, 2, 8]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"drop_remainder": True},
        {"no_padding": False, "padding_values": np.int64(-1)},
        {"padded_shapes": [12]},
        {"pad_to_bucket_boundary": True},
        {"pad_to_bucket_boundary": True, "padded_shapes": [None]},
    ],
    ids=["longest_in_batch", "drop_remainder", "padding_values", "padded_shapes", "to_boundary", "to_boundary_shapes"],
)
def test_bucket_by_sequence_length_equals_tf(options: dict[str, Any], same_elements: Any) -> None:
    lengths = [length for length in LENGTHS if length < 10]
    same_elements(
        *run_both(
            lambda D: ragged(D, lengths).bucket_by_sequence_length(length_func(D), [3, 6, 10], [2, 2, 3, 1], **options)
        )
    )


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_bucket_by_sequence_length_without_padding_equals_tf(drop_remainder: bool, same_elements: Any) -> None:
    def pipeline(D: Any) -> Any:
        as_int32 = (lambda value: tf.cast(value, tf.int32)) if D is TF else np.int32
        return (
            D.range(12)
            .map(lambda x: (x, x * 3))
            .bucket_by_sequence_length(
                lambda x, y: as_int32(x), [3, 6], [2, 3, 4], no_padding=True, drop_remainder=drop_remainder
            )
        )

    same_elements(*run_both(pipeline))


def test_bucket_by_sequence_length_of_tuples_pads_each_component(same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: D.zip((ragged(D, LENGTHS), D.range(len(LENGTHS)))).bucket_by_sequence_length(
                length_func(D), [4], [3, 2]
            )
        )
    )


def test_pad_to_bucket_boundary_rejects_elements_past_the_last_boundary(lib: Any) -> None:
    assert raises_on_iteration(
        lib,
        lambda D: ragged(D, [1, 9]).bucket_by_sequence_length(length_func(D), [3], [1, 1], pad_to_bucket_boundary=True),
    )


# scan, reduce, unique, take_while, get_single_element.


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.range(10).scan(np.int64(0), lambda state, x: (state + x, state)),
        lambda D: D.range(6).scan((np.int64(0), np.int64(1)), lambda s, _: ((s[1], s[0] + s[1]), s[0])),
        lambda D: D.from_tensors(np.int64(1)).repeat(8).scan(ints([0, 1]), lambda a, _: ([a[1], a[0] + a[1]], a[1])),
        lambda D: D.from_tensor_slices((ints([1, 2, 3, 4]), ints([10, 20, 30, 40]))).scan(
            np.int64(0), lambda state, element: (state + element[0], (state, element[1]))
        ),
        lambda D: D.range(5).scan(
            {"count": np.int64(0), "sum": np.float64(0)},
            lambda s, x: ({"count": s["count"] + 1, "sum": s["sum"] + np.float64(1.5)}, {"mean": s["sum"] / 5}),
        ),
        lambda D: D.range(0).scan(np.int64(0), lambda state, x: (state + x, state)),
        lambda D: D.range(4).scan(np.int64(3), lambda state, x: (state, x + state)).repeat(2),
    ],
    ids=[
        "running_sum",
        "fibonacci_tuple_state",
        "fibonacci_list_state",
        "tuple_element_not_unpacked",
        "dict_state",
        "empty",
        "repeat",
    ],
)
def test_scan_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


def test_scan_state_may_change_shape(same_elements: Any) -> None:
    def pipeline(D: Any) -> Any:
        concat = (lambda parts: tf.concat(parts, 0)) if D is TF else np.concatenate
        return D.from_tensors(np.int64(0)).repeat(4).scan(ints([1]), lambda state, x: (concat([state, state]), state))

    same_elements(*run_both(pipeline))


def test_scan_rejects_a_result_that_is_not_a_pair(lib: Any) -> None:
    with pytest.raises(TypeError, match="pair"):
        elements(lib.range(3).scan(np.int64(0), lambda state, x: x))


def test_scan_rejects_a_state_whose_dtype_changes(lib: Any) -> None:
    to_int32 = (lambda s: tf.cast(s, tf.int32)) if lib is TF else (lambda s: np.int32(s))
    with pytest.raises(TypeError, match="state"):
        elements(lib.range(3).scan(np.int64(0), lambda state, x: (to_int32(state), x)))


@pytest.mark.parametrize(
    ("pipeline", "initial_state", "reduce_func"),
    [
        (lambda D: D.range(5), np.int64(0), lambda state, x: state + x),
        (lambda D: D.range(0), np.int64(7), lambda state, x: state + x),
        (lambda D: D.range(6), (np.int64(0), np.int64(1)), lambda s, x: (s[0] + x, s[1] * (x + 1))),
        (
            lambda D: D.from_tensor_slices((ints([1, 2, 3]), ints([4, 5, 6]))),
            np.int64(0),
            lambda state, element: state + element[0] * element[1],
        ),
        (lambda D: D.range(4), {"n": np.int64(0)}, lambda state, x: {"n": state["n"] + 1}),
    ],
    ids=["sum", "empty", "tuple_state", "tuple_element", "dict_state"],
)
def test_reduce_equals_tf(pipeline: Pipeline, initial_state: Any, reduce_func: Any, same_elements: Any) -> None:
    expected = tf.nest.map_structure(lambda tensor: tensor.numpy(), pipeline(TF).reduce(initial_state, reduce_func))
    same_elements([pipeline(SF).reduce(initial_state, reduce_func)], [expected])


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.from_tensor_slices(ints([1, 3, 1, 2, 3, 5, 2])).unique(),
        lambda D: D.from_tensor_slices(np.array([4, 4, -1, 4], dtype=np.int32)).unique(),
        lambda D: D.from_tensor_slices(np.array([b"a", b"b", b"a", b"", b"b"])).unique(),
        lambda D: D.from_tensor_slices(ints([[1, 2], [1, 2], [3, 4], [2, 1]])).unique(),
        lambda D: D.range(10).repeat(3).unique(),
        lambda D: D.range(0).unique(),
    ],
    ids=["int64", "int32", "bytes", "vectors", "repeat", "empty"],
)
def test_unique_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.from_tensor_slices(np.array([1.0, 1.0])).unique(),
        lambda D: D.from_tensor_slices((ints([1, 1]), ints([1, 1]))).unique(),
    ],
    ids=["float", "tuple"],
)
def test_unique_rejects_what_tf_rejects(lib: Any, pipeline: Pipeline) -> None:
    assert raises_on_iteration(lib, pipeline)


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.range(10).take_while(lambda x: x < 4),
        lambda D: D.range(10).take_while(lambda x: x < 0),
        lambda D: D.range(5).take_while(lambda x: x < 10),
        lambda D: D.from_tensor_slices((ints([1, 2, 3, 1]), ints([5, 6, 7, 8]))).take_while(lambda a, b: a < 3),
        lambda D: D.range(10).take_while(lambda x: x % 5 != 3).repeat(2),
    ],
    ids=["stops", "empty", "never_false", "tuple_unpacked", "repeat"],
)
def test_take_while_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


def test_get_single_element_equals_tf(same_elements: Any) -> None:
    def pipeline(D: Any) -> Any:
        return D.from_tensors({"a": ints([1, 2]), "b": np.array([b"x"])})

    expected = tf.nest.map_structure(lambda tensor: tensor.numpy(), pipeline(TF).get_single_element())
    same_elements([pipeline(SF).get_single_element()], [expected])


@pytest.mark.parametrize("size", [0, 2])
def test_get_single_element_of_zero_or_two_elements_raises(lib: Any, size: int) -> None:
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=r"empty|more than one"):
        lib.range(size).get_single_element()


# counter and random.


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.counter().take(5),
        lambda D: D.counter(3, 2).take(4),
        lambda D: D.counter(10, -3).take(5),
        lambda D: D.counter(1, 2, dtype=tf.int32).take(3),
        lambda D: D.zip((D.counter(100), D.range(3))),
    ],
    ids=["default", "start_step", "negative_step", "int32", "zip"],
)
def test_counter_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


def test_random_yields_int64_uniform_below_2_to_32(lib: Any) -> None:
    values = np.array(elements(lib.random(seed=5).take(4000)))
    assert values.dtype == np.int64
    assert values.min() >= 0 and values.max() < 1 << 32
    # Mean and spread of a uniform over [0, 2**32), within several standard errors for 4000 draws.
    assert abs(values.mean() / 2**32 - 0.5) < 0.02
    assert abs(values.std() / 2**32 - 12**-0.5) < 0.02


@pytest.mark.parametrize(
    ("seed", "rerandomize", "repeats"),
    [(3, None, True), (3, False, True), (3, True, False), (None, None, True), (None, True, False)],
)
def test_random_repeats_per_iteration_as_tf(
    lib: Any, seed: int | None, rerandomize: bool | None, repeats: bool
) -> None:
    dataset = lib.random(seed=seed, rerandomize_each_iteration=rerandomize).take(4)
    assert (scalars(dataset) == scalars(dataset)) == repeats
    epochs = scalars(dataset.repeat(2))
    assert (epochs[:4] == epochs[4:]) == repeats


def test_random_with_a_seed_repeats_across_datasets(lib: Any) -> None:
    assert scalars(lib.random(seed=9).take(5)) == scalars(lib.random(seed=9).take(5))
    assert scalars(lib.random(seed=9).take(5)) != scalars(lib.random(seed=10).take(5))


# rejection_resample.


def resampled_values(lib: Any, seed: int) -> list[int]:
    """The elements of range(200) kept when resampling half of class 1 (x % 4 == 0) and half of class 0."""
    class_func = (lambda x: tf.cast(x % 4 == 0, tf.int64)) if lib is TF else (lambda x: np.int64(x % 4 == 0))
    resampled = lib.range(200).rejection_resample(class_func, [0.5, 0.5], initial_dist=[0.75, 0.25], seed=seed)
    pairs = elements(resampled)
    assert all(int(label) == int(value % 4 == 0) for label, value in pairs)  # (class_func(element), element)
    return [int(value) for _, value in pairs]


def test_rejection_resample_with_a_seed_repeats(lib: Any) -> None:
    assert resampled_values(lib, 3) == resampled_values(lib, 3)


def test_rejection_resample_of_an_alternating_input_reaches_a_skewed_target(lib: Any) -> None:
    # Every element is read (the input ends), and the classes are on target whatever the input's order.
    pairs = elements(lib.range(3000).rejection_resample(lambda x: x % 2, [0.9, 0.1], initial_dist=[0.5, 0.5], seed=27))
    frequencies = np.bincount([int(label) for label, _ in pairs], minlength=2) / len(pairs)
    np.testing.assert_allclose(frequencies, [0.9, 0.1], atol=0.02)


def test_rejection_resample_of_a_shuffled_input_with_an_estimated_distribution(lib: Any) -> None:
    classes = np.arange(3000, dtype=np.int64) % 5
    dataset = (
        lib.from_tensor_slices(classes)
        .shuffle(200, seed=21)
        .map(lambda c: (c, c * 10))
        .repeat()
        .rejection_resample(lambda c, _: c, [0.9, 0.05, 0.05, 0.0, 0.0], seed=27)
        .take(1000)
    )
    pairs = elements(dataset)
    assert all(int(tens) == 10 * int(label) for label, (_, tens) in pairs)
    frequencies = np.bincount([int(label) for label, _ in pairs], minlength=5) / len(pairs)
    np.testing.assert_allclose(frequencies, [0.9, 0.05, 0.05, 0.0, 0.0], atol=0.03)


def test_rejection_resample_to_a_single_class_ends_with_its_input(lib: Any) -> None:
    pairs = elements(lib.range(100).rejection_resample(lambda x: x % 2, [0.0, 1.0], initial_dist=[0.5, 0.5], seed=2))
    assert [int(value) for _, value in pairs] == list(range(1, 100, 2))


def test_rejection_resample_keeps_everything_when_the_target_is_the_initial_distribution(lib: Any) -> None:
    pairs = elements(lib.range(100).rejection_resample(lambda x: x % 2, [0.5, 0.5], initial_dist=[0.5, 0.5], seed=1))
    assert [int(value) for _, value in pairs] == list(range(100))


# sparse_batch.


def sparse_batches(lib: Any, pipeline: Pipeline) -> list[tuple[list[Any], list[Any], list[int]]]:
    return [
        (np.asarray(batch.indices).tolist(), np.asarray(batch.values).tolist(), np.asarray(batch.dense_shape).tolist())
        for batch in pipeline(lib)
    ]


def filled(lib: Any, shape: Callable[[Any], Any]) -> Callable[[Any], Any]:
    if lib is TF:
        return lambda x: tf.fill(shape(x), x)
    return lambda x: np.full(shape(x), x)


@pytest.mark.parametrize(
    ("pipeline_for", "row_shape"),
    [
        (lambda D: D.from_tensor_slices(ints([1, 2, 3, 4, 0])).map(filled(D, lambda x: [x])), [5]),
        (lambda D: D.from_tensor_slices(ints([1, 2, 0])).map(filled(D, lambda x: [x, 2])), [5, 2]),
        (lambda D: D.from_tensor_slices(ints([0, 0])).map(filled(D, lambda x: [x])), [3]),
        (lambda D: D.from_tensor_slices(np.array([[b"a", b"b"], [b"c", b"d"]])), [3]),
    ],
    ids=["vectors", "matrices", "all_empty", "bytes"],
)
@pytest.mark.parametrize("batch_size", [2, 3])
def test_sparse_batch_equals_tf(pipeline_for: Pipeline, row_shape: list[int], batch_size: int) -> None:
    def pipeline(D: Any) -> Any:
        return pipeline_for(D).sparse_batch(batch_size, row_shape)

    assert sparse_batches(SF, pipeline) == sparse_batches(TF, pipeline)


def test_sparse_batch_rejects_an_element_larger_than_row_shape(lib: Any) -> None:
    assert raises_on_iteration(lib, lambda D: D.from_tensor_slices(ints([[1, 2, 3, 4]])).sparse_batch(2, [3]))


# save, load and snapshot: each library reads back what it wrote.


def saved_pipeline(lib: Any) -> Any:
    return lib.range(20).map(lambda x: {"id": x, "pair": (x * 2, x * 3)})


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_load_returns_what_save_wrote_in_order(
    lib: Any, tmp_path: Path, compression: str | None, same_elements: Any
) -> None:
    saved_pipeline(lib).save(str(tmp_path / "saved"), compression=compression)
    same_elements(elements(lib.load(str(tmp_path / "saved"), compression=compression)), elements(saved_pipeline(lib)))


def test_load_of_a_sharded_save_returns_every_element(lib: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "saved")
    lib.range(30).save(path, shard_func=lambda x: x % 3)
    assert sorted(scalars(lib.load(path))) == list(range(30))


def test_load_with_a_reader_func_reads_the_shards_in_its_order(lib: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "saved")
    lib.range(12).save(path, shard_func=lambda x: x % 2)
    loaded = lib.load(path, reader_func=lambda shards: shards.flat_map(lambda shard: shard))
    values = scalars(loaded)
    assert sorted(values) == list(range(12))
    assert values in ([0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11], [1, 3, 5, 7, 9, 11, 0, 2, 4, 6, 8, 10])


def test_save_replaces_an_earlier_save(lib: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "saved")
    lib.range(5).save(path)
    lib.range(100, 103).save(path)
    assert scalars(lib.load(path)) == [100, 101, 102]


def test_snapshot_second_pass_reads_what_the_first_wrote(lib: Any, tmp_path: Path) -> None:
    source = [1, 2, 3]

    def rows() -> Any:
        yield from list(source)

    spec = tf.TensorSpec((), tf.int64) if lib is TF else data.TensorSpec((), np.int64)
    dataset = lib.from_generator(rows, output_signature=spec).snapshot(str(tmp_path / "snap"))
    assert scalars(dataset) == [1, 2, 3]
    source.append(4)  # the generator changes, the snapshot does not
    assert scalars(dataset) == [1, 2, 3]


def test_snapshot_of_an_interrupted_pass_is_not_used(lib: Any, tmp_path: Path) -> None:
    source = [1, 2, 3]

    def rows() -> Any:
        yield from list(source)

    spec = tf.TensorSpec((), tf.int64) if lib is TF else data.TensorSpec((), np.int64)
    dataset = lib.from_generator(rows, output_signature=spec).snapshot(str(tmp_path / "snap"))
    iterator = iter(dataset)
    next(iterator)
    del iterator
    source.append(4)
    assert scalars(dataset) == [1, 2, 3, 4]


# fingerprint.


def test_fingerprint_is_equal_for_equal_pipelines_and_differs_otherwise(lib: Any) -> None:
    def build(stop: int, offset: int) -> Any:
        return lib.range(stop).map(lambda x: x + offset).batch(2)

    same = int(build(10, 1).fingerprint()), int(build(10, 1).fingerprint())
    assert same[0] == same[1]
    assert int(build(11, 1).fingerprint()) != same[0]
    assert int(lib.range(10).map(lambda x: x * 3).batch(2).fingerprint()) != same[0]
    assert np.asarray(build(10, 1).fingerprint()).dtype == np.uint64
