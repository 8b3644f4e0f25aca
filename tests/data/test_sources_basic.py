"""Sources built in memory: range, from_tensors, from_tensor_slices, from_generator, list_files and zip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardflow import data

D = data.Dataset


def test_range_yields_int64_scalars() -> None:
    elements = list(D.range(3))
    assert elements == [0, 1, 2]
    assert all(isinstance(element, np.int64) for element in elements)


def test_range_rejects_zero_step_and_too_many_arguments() -> None:
    with pytest.raises(ValueError, match="step must not be 0"):
        D.range(0, 5, 0)
    with pytest.raises(TypeError, match=r"range takes \(stop\)"):
        D.range(1, 2, 3, 4)


def test_from_tensor_slices_turns_strings_into_bytes() -> None:
    assert list(D.from_tensor_slices(["a", "bc"])) == [b"a", b"bc"]


def test_from_tensor_slices_names_the_unequal_first_dimensions() -> None:
    with pytest.raises(ValueError, match=r"equal first dimensions, got shapes \(3,\), \(2,\)"):
        D.from_tensor_slices({"a": np.zeros(3), "b": np.zeros(2)})


def test_from_tensor_slices_rejects_scalars() -> None:
    with pytest.raises(ValueError, match="rank >= 1"):
        D.from_tensor_slices(np.float32(1.0))


def test_from_tensors_rejects_none() -> None:
    with pytest.raises(TypeError, match="cannot contain None"):
        D.from_tensors({"a": None})


def squares(limit: int) -> Any:
    for value in range(limit):
        yield {"x": value * value, "name": f"n{value}"}


def test_from_generator_converts_with_output_signature() -> None:
    signature = {"x": data.TensorSpec((), np.int32), "name": data.TensorSpec((), bytes)}
    elements = list(D.from_generator(squares, output_signature=signature, args=(3,)))
    assert [element["x"] for element in elements] == [0, 1, 4]
    assert elements[2]["x"].dtype == np.int32
    assert elements[1]["name"] == b"n1"


def test_from_generator_restores_by_rerunning_and_skipping() -> None:
    dataset = D.from_generator(squares, args=(6,))
    iterator = iter(dataset)
    next(iterator), next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    assert state == {"consumed": 2}
    restored = iter(dataset)
    restored.set_state(state)
    assert [element["x"] for element in restored] == [4, 9, 16, 25]


def test_from_generator_names_structure_and_shape_mismatches() -> None:
    with pytest.raises(TypeError, match=r"yielded structure \{'x': ., 'name': .\}, but output_signature is \."):
        list(D.from_generator(squares, output_signature=data.TensorSpec(()), args=(1,)))
    with pytest.raises(ValueError, match=r"yielded shape \(3,\), output_signature expects \(2,\)"):
        list(D.from_generator(lambda: iter([np.zeros(3)]), output_signature=data.TensorSpec((2,))))
    with pytest.raises(TypeError, match="needs a callable"):
        D.from_generator([1, 2])  # type: ignore[arg-type]


@pytest.fixture
def shard_files(tmp_path: Path) -> list[bytes]:
    names = [tmp_path / f"part-{index:02d}.txt" for index in range(6)]
    for name in names:
        name.write_text("x")
    return [str(name).encode() for name in names]


def test_list_files_sorted_without_shuffle(shard_files: list[bytes], tmp_path: Path) -> None:
    assert list(D.list_files(str(tmp_path / "part-*.txt"), shuffle=False)) == shard_files


def test_list_files_shuffles_by_default_and_reshuffles_each_pass(shard_files: list[bytes], tmp_path: Path) -> None:
    files = D.list_files(str(tmp_path / "part-*.txt"), seed=3)
    first, second = list(files), list(files)
    assert sorted(first) == sorted(second) == shard_files
    assert first != second  # a new pass reshuffles, as tf.data's list_files does
    assert list(D.list_files(str(tmp_path / "part-*.txt"), seed=3)) == first


def test_list_files_takes_several_patterns(shard_files: list[bytes], tmp_path: Path) -> None:
    patterns = [str(tmp_path / "part-0[0-1].txt"), str(tmp_path / "part-05.txt")]
    assert list(D.list_files(patterns, shuffle=False)) == [shard_files[0], shard_files[1], shard_files[5]]


def test_list_files_names_the_pattern_that_matched_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no files matched pattern .*missing-\*\.rec"):
        D.list_files(str(tmp_path / "missing-*.rec"))


def test_zip_stops_at_the_shortest_and_rejects_non_datasets() -> None:
    assert list(D.zip(D.range(2), D.range(5))) == [(0, 0), (1, 1)]
    with pytest.raises(TypeError, match="zip takes datasets"):
        D.zip((D.range(2), [1, 2]))
