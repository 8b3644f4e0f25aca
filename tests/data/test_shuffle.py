"""shuffle: a seeded windowed permutation that reshuffles per pass and keeps errors in place."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardflow import data

D = data.Dataset


def test_shuffle_is_a_permutation_reproducible_by_seed() -> None:
    first = list(D.range(100).shuffle(30, seed=4))
    assert sorted(first) == list(range(100)) and first != list(range(100))
    assert list(D.range(100).shuffle(30, seed=4)) == first
    assert list(D.range(100).shuffle(30, seed=5)) != first


def test_elements_stay_within_their_window_of_buffer_size() -> None:
    shuffled = list(D.range(100).shuffle(25, seed=1))
    assert [sorted(shuffled[start : start + 25]) for start in range(0, 100, 25)] == [
        list(range(start, start + 25)) for start in range(0, 100, 25)
    ]


def test_buffer_size_one_keeps_the_order() -> None:
    assert list(D.range(10).shuffle(1, seed=3)) == list(range(10))


def test_reshuffle_each_iteration_controls_later_passes() -> None:
    reshuffled = D.range(20).shuffle(20, seed=2)
    assert list(reshuffled) != list(reshuffled)
    fixed = D.range(20).shuffle(20, seed=2, reshuffle_each_iteration=False)
    assert list(fixed) == list(fixed)
    epochs = list(D.range(20).shuffle(20, seed=2, reshuffle_each_iteration=False).repeat(2))
    assert epochs[:20] == epochs[20:]


def test_without_a_seed_the_state_still_restores_exactly() -> None:
    iterator = iter(D.range(50).shuffle(50))
    [next(iterator) for _ in range(10)]
    restored = iter(D.range(50).shuffle(50))  # another dataset object, with another random seed
    restored.set_state(json.loads(json.dumps(iterator.get_state())))
    assert list(restored) == list(iterator)


def outcomes_from(iterator: data.DatasetIterator[Any]) -> list[Any]:
    """Every element, with "error" where next() raised ValueError."""
    outcomes: list[Any] = []
    while True:
        try:
            outcomes.append(next(iterator))
        except ValueError:
            outcomes.append("error")
        except StopIteration:
            return outcomes


def test_an_input_error_is_raised_at_its_place_in_the_window_and_restores() -> None:
    def fail_on_five(x: Any) -> Any:
        if x == 5:
            raise ValueError("five")
        return x

    def make() -> data.Dataset[Any]:
        return D.range(12).map(fail_on_five).shuffle(12, seed=0)

    everything = outcomes_from(iter(make()))
    assert sorted(map(str, everything)) == sorted([*(str(x) for x in range(12) if x != 5), "error"])
    for k in (3, everything.index("error"), everything.index("error") + 1):
        iterator = iter(make())
        head = [next(iterator) for _ in range(k)] if "error" not in everything[:k] else None
        if head is None:
            continue
        restored = iter(make())
        restored.set_state(iterator.get_state())
        assert head + outcomes_from(restored) == everything


def test_buffer_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="shuffle buffer_size must be a positive int, got 0"):
        D.range(3).shuffle(0)
