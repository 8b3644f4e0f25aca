"""Cardinality without iterating, assert_cardinality, and element_spec where no static spec exists (the rules
themselves are compared with tf.data in compat/test_tfdata_api.py)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from shardflow import data
from shardflow.data.dataset import DatasetIterator, State

D = data.Dataset


class CountdownDataset(data.Dataset[Any]):
    """A user-defined source: shardflow has no cardinality rule for it."""

    def _iterator(self) -> DatasetIterator[Any]:
        return iter(D.range(3))


def test_a_dataset_type_without_a_rule_has_an_unknown_count() -> None:
    assert CountdownDataset().cardinality() == data.UNKNOWN_CARDINALITY
    assert CountdownDataset().map(lambda x: x).batch(2).cardinality() == data.UNKNOWN_CARDINALITY


def test_cardinality_follows_a_long_pipeline_without_iterating_it() -> None:
    def never_called(x: Any) -> Any:
        raise AssertionError("cardinality must not run map functions")

    pipeline = D.range(100).map(never_called).shuffle(10).batch(7).skip(2).take(100).repeat(3).shard(4, 1)
    assert pipeline.cardinality() == 10  # 15 batches, 13 after skip, 39 repeated, shard 1 of 4 gets 10
    assert len(pipeline) == 10


def test_list_of_a_dataset_of_unknown_count_works() -> None:
    # list() asks len() for a size hint; the TypeError of an unknown count must only drop the hint.
    assert list(D.range(5).filter(lambda x: x % 2 == 0)) == [0, 2, 4]


def test_an_empty_dataset_is_still_true() -> None:
    assert D.range(0)
    assert D.range(3).repeat()


def test_assert_cardinality_declares_the_count_of_an_unknown_pipeline() -> None:
    declared = D.range(10).filter(lambda x: x >= 0).apply(data.experimental.assert_cardinality(10))
    assert declared.cardinality() == 10 and len(declared) == 10
    assert declared.batch(4).cardinality() == 3


def test_assert_cardinality_state_keeps_the_count_seen() -> None:
    declared = D.range(5).apply(data.experimental.assert_cardinality(4))
    iterator = iter(declared)
    assert [next(iterator) for _ in range(3)] == [0, 1, 2]
    state: State = json.loads(json.dumps(iterator.get_state()))
    restored = iter(declared)
    restored.set_state(state)
    assert next(restored) == 3
    with pytest.raises(data.errors.FailedPreconditionError, match="more than the 4 elements expected"):
        next(restored)


def test_assert_cardinality_names_the_count_found() -> None:
    with pytest.raises(data.errors.FailedPreconditionError, match="has 2 elements, expected 3"):
        list(D.range(2).apply(data.experimental.assert_cardinality(3)))


def test_assert_cardinality_of_infinite_fails_when_the_input_ends() -> None:
    declared = D.range(2).apply(data.experimental.assert_cardinality(data.INFINITE_CARDINALITY))
    assert declared.cardinality() == data.INFINITE_CARDINALITY
    with pytest.raises(data.errors.FailedPreconditionError, match="expected an infinite number"):
        list(declared)


@pytest.mark.parametrize("expected", [-2, -5, 1.5])
def test_assert_cardinality_refuses_counts_that_are_not_counts(expected: Any) -> None:
    with pytest.raises(ValueError, match="assert_cardinality expects a count"):
        D.range(2).apply(data.experimental.assert_cardinality(expected))


def test_element_spec_of_a_map_is_read_from_the_first_element() -> None:
    # tf.data traces the function and would say (None,) here; shardflow can only look at an element.
    spec = D.range(3).batch(2).map(lambda batch: {"doubled": batch * 2, "name": b"x"}).element_spec
    assert spec == {"doubled": data.TensorSpec((2,), np.int64), "name": data.TensorSpec((), bytes)}


def test_element_spec_of_an_empty_pipeline_without_a_static_spec_is_an_error() -> None:
    with pytest.raises(ValueError, match="no static spec and yields no element"):
        _ = D.range(0).map(lambda x: x).element_spec


def test_element_spec_of_windows_is_not_supported() -> None:
    with pytest.raises(TypeError, match=r"a leaf of type \w*Dataset has no TensorSpec"):
        _ = D.range(4).window(2).element_spec


def test_element_spec_of_a_generator_signature_normalizes_shapes_and_dtypes() -> None:
    signature = {"ids": data.TensorSpec([None, 2], "int32"), "text": data.TensorSpec((), object)}
    spec = D.from_generator(lambda: iter([]), output_signature=signature).element_spec
    assert spec == {"ids": data.TensorSpec((None, 2), np.int32), "text": data.TensorSpec((), bytes)}


def test_range_output_type_sets_the_element_dtype() -> None:
    elements = list(D.range(3, output_type=np.int32))
    assert [element.dtype for element in elements] == [np.dtype(np.int32)] * 3
    with pytest.raises(TypeError, match="output_type must be an integer or float dtype"):
        D.range(3, output_type=bytes)


def test_from_generator_takes_output_signature_or_output_types_not_both() -> None:
    with pytest.raises(TypeError, match="not both"):
        D.from_generator(lambda: iter([1]), output_types=np.int64, output_signature=data.TensorSpec((), np.int64))
    with pytest.raises(TypeError, match="output_shapes needs output_types"):
        D.from_generator(lambda: iter([1]), output_shapes=())
