"""next_many: the lists an iterator hands over hold exactly what next() would give, errors stay in place, and a state
saved between lists resumes exactly."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardflow import data
from shardflow.data.dataset import has_bulk_next

D = data.Dataset
MakePipeline = Callable[[], data.Dataset[Any]]


def fail_on_multiples_of_seven(x: Any) -> Any:
    if x % 7 == 0:
        raise ValueError(f"bad {x}")
    return x


def uneven(x: Any) -> data.Dataset[Any]:
    return D.range(x * 100, x * 100 + x % 5 + 1).map(fail_on_multiples_of_seven)


def record_files(directory: Path) -> list[str]:
    files = []
    for index in range(5):
        path = str(directory / f"part-{index}.tfrecord")
        with data.TFRecordWriter(path) as writer:
            for record in range(3 + 4 * index):
                writer.write(b"%d:%d" % (index, record))
        files.append(path)
    return files


def pipelines(files: list[str]) -> dict[str, MakePipeline]:
    return {
        "interleave with errors": lambda: D.range(1, 12).interleave(uneven, cycle_length=3, block_length=2),
        "interleave read ahead": lambda: D.range(1, 12).interleave(uneven, cycle_length=4, num_parallel_calls=2),
        "interleave of files": lambda: D.from_tensor_slices(files).interleave(data.TFRecordDataset, cycle_length=3),
        "interleave shuffle": lambda: (
            D.from_tensor_slices(files).interleave(data.TFRecordDataset, cycle_length=2, block_length=3).shuffle(9, 4)
        ),
        "shuffle with errors": lambda: D.range(60).map(fail_on_multiples_of_seven).shuffle(16, seed=3),
        "prefetch": lambda: D.range(1, 12).interleave(uneven, cycle_length=2).prefetch(5),
        "thread map": lambda: D.range(40).map(fail_on_multiples_of_seven, num_parallel_calls=3).prefetch(2),
        "slices": lambda: D.from_tensor_slices({"x": np.arange(30), "y": np.arange(60).reshape(30, 2)}),
    }


def outcome(value: Any) -> Any:
    return json.dumps(value.tolist() if isinstance(value, np.ndarray) else value, default=repr)


def by_next(iterator: data.DatasetIterator[Any], limit: int | None = None) -> list[Any]:
    """Outcomes of next() calls: each element (as comparable text), or "error: ..." where it raised."""
    outcomes: list[Any] = []
    while limit is None or len(outcomes) < limit:
        try:
            outcomes.append(outcome(next(iterator)))
        except StopIteration:
            break
        except ValueError as error:
            outcomes.append(f"error: {error}")
    return outcomes


def by_next_many(iterator: data.DatasetIterator[Any], sizes: list[int], limit: int | None = None) -> list[Any]:
    """The same outcomes read with next_many, asking for sizes[0], sizes[1], ... (cycled) elements at a time."""
    outcomes: list[Any] = []
    call = 0
    while limit is None or len(outcomes) < limit:
        size = sizes[call % len(sizes)] if limit is None else min(sizes[call % len(sizes)], limit - len(outcomes))
        call += 1
        try:
            elements = iterator.next_many(size)
        except StopIteration:
            break
        except ValueError as error:
            outcomes.append(f"error: {error}")
            continue
        assert 1 <= len(elements) <= size
        outcomes += [outcome(element) for element in elements]
    return outcomes


@pytest.fixture(scope="module")
def pipelines_in(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MakePipeline]:
    return pipelines(record_files(tmp_path_factory.mktemp("records")))


NAMES = sorted(pipelines([]))


@pytest.mark.parametrize("name", NAMES)
def test_lists_from_next_many_hold_what_next_gives_with_errors_in_place(
    name: str, pipelines_in: dict[str, MakePipeline]
) -> None:
    make = pipelines_in[name]
    expected = by_next(iter(make()))
    for sizes in ([1], [5], [1000], [3, 1, 8]):
        iterator = iter(make())
        assert by_next_many(iterator, sizes) == expected, sizes
        iterator.close()


def test_the_stages_of_the_design_pipeline_hand_over_lists(tmp_path: Path) -> None:
    files = record_files(tmp_path)
    stages = D.from_tensor_slices(files).interleave(data.TFRecordDataset, cycle_length=3, num_parallel_calls=2)
    for dataset in (stages, stages.shuffle(10), stages.prefetch(4), data.TFRecordDataset(files)):
        iterator = iter(dataset)
        assert has_bulk_next(iterator)
        iterator.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(NAMES),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    taken=st.integers(0, 40),
)
def test_a_state_saved_between_lists_resumes_exactly(
    name: str, sizes: list[int], taken: int, pipelines_in: dict[str, MakePipeline]
) -> None:
    make = pipelines_in[name]
    assert resumed(make, sizes, taken) == by_next(iter(make()))


@pytest.mark.parametrize("name", ["interleave with errors", "interleave read ahead", "interleave of files"])
@pytest.mark.parametrize("sizes", [[2], [7], [3, 50]])
def test_interleave_resumes_exactly_from_a_state_saved_after_any_list(
    name: str, sizes: list[int], pipelines_in: dict[str, MakePipeline]
) -> None:
    make = pipelines_in[name]
    expected = by_next(iter(make()))
    for taken in range(len(expected) + 1):
        assert resumed(make, sizes, taken) == expected, taken


def resumed(make: MakePipeline, sizes: list[int], taken: int) -> list[Any]:
    """`taken` elements read in lists of `sizes`, then the rest from a fresh iterator restored to the state saved
    there (JSON round-tripped)."""
    iterator = iter(make())
    head = by_next_many(iterator, sizes, limit=taken)
    state = json.loads(json.dumps(iterator.get_state()))
    iterator.close()
    restored = iter(make())
    restored.set_state(state)
    rest = by_next(restored)
    restored.close()
    return head + rest
