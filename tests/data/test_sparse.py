"""SparseTensor as an element's leaf: batched with a leading batch dimension, made dense, and handed to torch."""

from __future__ import annotations

import numpy as np
import torch

from shardflow import data
from shardflow.data.sparse import SparseTensor
from shardflow.data.torch_edge import to_torch

FEATURES = {"ids": data.VarLenFeature(np.int64)}


def records() -> list[bytes]:
    return [data.make_example({"ids": np.array(values, np.int64)}) for values in ([3, 1], [], [7, 8, 9])]


def test_batching_sparse_leaves_prepends_the_batch_index_and_takes_the_largest_shape() -> None:
    parsed = data.Dataset.from_tensor_slices(records()).map(lambda record: data.parse_single_example(record, FEATURES))
    (batch,) = list(parsed.batch(3))
    ids = batch["ids"]
    assert ids.indices.tolist() == [[0, 0], [0, 1], [2, 0], [2, 1], [2, 2]]
    assert ids.values.tolist() == [3, 1, 7, 8, 9]
    assert ids.dense_shape.tolist() == [3, 3]


def test_numpy_fills_the_missing_values_with_zeros_or_empty_bytes() -> None:
    numbers = SparseTensor(np.array([[0, 1], [1, 0]]), np.array([5, 6], np.int32), np.array([2, 2]))
    assert numbers.numpy().tolist() == [[0, 5], [6, 0]] and numbers.numpy().dtype == np.int32
    strings = SparseTensor(np.array([[1]]), np.array([b"x"], dtype=object), np.array([2]))
    assert strings.numpy().tolist() == [b"", b"x"]


def test_to_torch_makes_a_sparse_coo_tensor_with_the_same_dense_values() -> None:
    ids = data.parse_example(records(), FEATURES)["ids"]
    assert isinstance(ids, SparseTensor)
    tensor = to_torch(ids)
    assert tensor.is_sparse and tensor.dtype == torch.int64
    assert tensor.to_dense().tolist() == ids.numpy().tolist()


def test_sparse_leaves_of_strings_stay_numpy_for_torch() -> None:
    strings = SparseTensor(np.array([[0]]), np.array([b"x"], dtype=object), np.array([1]))
    assert to_torch({"names": strings})["names"] is strings


def _sparse_row(i: np.integer) -> SparseTensor:
    n = int(i) % 3 + 1
    return SparseTensor(
        np.arange(n, dtype=np.int64).reshape(n, 1), np.full(n, float(i), np.float32), np.array([4], np.int64)
    )


def _same(a: list[SparseTensor], b: list[SparseTensor]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.indices, y.indices)
        and np.array_equal(x.values, y.values)
        and np.array_equal(x.dense_shape, y.dense_shape)
        for x, y in zip(a, b, strict=True)
    )


def test_sparse_elements_cross_worker_processes_and_the_file_cache(tmp_path):
    expected = [_sparse_row(np.int64(i)) for i in range(7)]
    in_processes = data.Dataset.range(7).map(_sparse_row, num_parallel_calls=2, use_processes=True)
    assert _same(list(in_processes), expected)
    cached = data.Dataset.range(7).map(_sparse_row).cache(str(tmp_path / "sparse"))
    assert _same(list(cached), expected)
    assert _same(list(cached), expected)  # the second pass reads the cache file
