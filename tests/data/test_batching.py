"""batch, padded_batch, unbatch, rebatch and window: behaviour and error messages beyond the tf.data compat tests."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from shardflow import data

D = data.Dataset


def ragged(lengths: list[int]) -> Any:
    return D.from_generator(lambda: (np.ones(length, dtype=np.int32) for length in lengths))


def test_batch_names_the_component_with_unequal_shapes_and_suggests_padded_batch() -> None:
    elements = ragged([1, 2]).map(lambda row: {"row": row})
    with pytest.raises(ValueError, match=r"component \['row'\] has different shapes \[\(1,\), \(2,\)\].*padded_batch"):
        list(elements.batch(2))


def test_batch_rejects_a_non_positive_batch_size() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        D.range(3).batch(0)


def test_batch_rejects_elements_of_different_structure() -> None:
    mixed = D.from_generator(lambda: iter([{"a": 1}, {"b": 2}]))
    with pytest.raises(ValueError, match=r"batch: element 1 has structure \{'b': .\}, element 0 has \{'a': .\}"):
        list(mixed.batch(2))


def test_padded_batch_names_a_component_longer_than_its_padded_shape() -> None:
    with pytest.raises(ValueError, match=r"size 3 in dimension 0, more than padded_shapes allows \(2\)"):
        list(ragged([1, 3]).padded_batch(2, padded_shapes=[2]))


def test_padded_batch_checks_the_padded_shapes_structure() -> None:
    pairs = D.zip((ragged([1, 2]), ragged([2, 1])))
    with pytest.raises(ValueError, match="padded_shapes must have the element's structure"):
        list(pairs.padded_batch(2, padded_shapes={"a": [None]}))


def test_padded_batch_one_padding_value_for_every_component() -> None:
    pairs = D.zip((ragged([1, 2]), ragged([2, 1])))
    (left, right) = next(iter(pairs.padded_batch(2, padding_values=np.int32(7))))
    assert left.tolist() == [[1, 7], [1, 1]] and right.tolist() == [[1, 1], [1, 7]]


def test_unbatch_rejects_scalars() -> None:
    with pytest.raises(ValueError, match="unbatch needs components of rank >= 1"):
        list(D.range(3).unbatch())


def test_unbatch_restores_inside_a_batch() -> None:
    dataset = D.range(10).batch(4).unbatch()
    iterator = iter(dataset)
    [next(iterator) for _ in range(5)]
    state = json.loads(json.dumps(iterator.get_state()))
    restored = iter(dataset)
    restored.set_state(state)
    assert list(restored) == [5, 6, 7, 8, 9]


def test_rebatch_rejects_empty_size_lists() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        D.range(4).batch(2).rebatch([])


def test_window_elements_are_datasets_per_component() -> None:
    window = next(iter(D.zip((D.range(3), D.range(3))).window(2)))
    assert isinstance(window, tuple) and all(isinstance(part, data.Dataset) for part in window)
    assert list(window[0]) == [0, 1]


def test_window_rejects_non_positive_arguments() -> None:
    with pytest.raises(ValueError, match="window shift must be a positive int, got 0"):
        D.range(3).window(2, shift=0)


@pytest.mark.parametrize(("size", "shift", "stride"), [(3, 1, 1), (2, 5, 1), (3, 2, 2), (4, None, 1)])
def test_window_restores_between_windows(size: int, shift: int | None, stride: int) -> None:
    dataset = D.range(23).window(size, shift, stride).flat_map(lambda window: window.batch(size))
    expected = [batch.tolist() for batch in dataset]
    for k in range(len(expected)):
        iterator = iter(dataset)
        head = [next(iterator).tolist() for _ in range(k)]
        restored = iter(dataset)
        restored.set_state(json.loads(json.dumps(iterator.get_state())))
        assert head + [batch.tolist() for batch in restored] == expected
