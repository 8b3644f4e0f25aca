"""as_torch: numeric leaves as torch tensors, bytes left as numpy, copies ahead to a device, state kept."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shardflow import data

D = data.Dataset


def records() -> data.Dataset[object]:
    return D.from_tensor_slices(
        {"x": np.arange(12, dtype=np.float32).reshape(6, 2), "label": np.arange(6), "id": np.array([b"a"] * 6)}
    ).batch(2)


def test_numeric_leaves_become_tensors_and_bytes_stay_numpy() -> None:
    batch = next(iter(records().as_torch()))
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].dtype == torch.float32 and batch["x"].shape == (2, 2)
    assert batch["label"].dtype == torch.int64
    assert isinstance(batch["id"], np.ndarray) and batch["id"].tolist() == [b"a", b"a"]


def test_scalars_become_zero_dimensional_tensors() -> None:
    assert next(iter(D.range(3).as_torch())).shape == ()


def test_read_only_arrays_are_copied_not_shared() -> None:
    frozen = np.arange(4)
    frozen.setflags(write=False)
    tensor = next(iter(D.from_tensors(frozen).as_torch()))
    tensor += 1
    assert frozen.tolist() == [0, 1, 2, 3]


def test_device_path_copies_ahead_and_keeps_the_state() -> None:
    # The meta device exercises the copy-ahead path without CUDA.
    iterator = iter(records().as_torch(device="meta"))
    first = next(iterator)
    assert first["x"].device.type == "meta"
    state = json.loads(json.dumps(iterator.get_state()))
    iterator.close()
    restored = iter(records().as_torch(device="meta"))
    restored.set_state(state)
    assert [tuple(batch["label"].shape) for batch in restored] == [(2,), (2,)]
    restored.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_pin_memory_without_cuda_names_the_fix() -> None:
    with pytest.raises(ValueError, match="drop pin_memory"):
        iter(records().as_torch(pin_memory=True))
