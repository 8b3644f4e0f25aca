"""to_torch(), and the conversion behind as_torch(): numeric numpy leaves become torch tensors at the pipeline's edge,
optionally copied to a device. `shardflow.data` imports this module, and so torch, only when as_torch() is called."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator
from shardflow.data.prefetch import PrefetchIterator
from shardflow.data.sparse import SparseTensor

# Elements copied ahead to the device: one in use by the step, one in flight.
_DEVICE_PREFETCH = 2


class TorchDataset(UnaryDataset[Any]):
    """The input's elements converted by to_torch(), and copied ahead to `device` when it is not the CPU."""

    def __init__(self, input_dataset: Dataset[Any], device: Any, pin_memory: bool) -> None:
        super().__init__(input_dataset)
        self._device = device
        self._pin_memory = pin_memory

    def _iterator(self) -> DatasetIterator[Any]:
        device = None if self._device is None else torch.device(self._device)
        if self._pin_memory and not torch.cuda.is_available():
            raise ValueError("as_torch(pin_memory=True) needs CUDA, which this torch build cannot use; drop pin_memory")
        converter = _TorchIterator(iter(self._input), device, self._pin_memory)
        if device is None or device.type == "cpu":
            return converter
        return _DeviceIterator(PrefetchIterator(converter, _DEVICE_PREFETCH))


def to_torch(element: Any) -> Any:
    """`element` with its numeric numpy values as torch tensors (sharing memory unless read-only), inside dicts,
    tuples and lists; strings, tensors and other values as they are. Where a training step meets its batch."""
    if isinstance(element, dict):
        return {key: to_torch(value) for key, value in element.items()}
    if isinstance(element, tuple):
        items = [to_torch(value) for value in element]
        return type(element)(*items) if hasattr(element, "_fields") else tuple(items)
    if isinstance(element, list):
        return [to_torch(value) for value in element]
    return _to_tensor(element)


def _to_tensor(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
        if leaf.dtype == object or leaf.dtype.kind in "USV":
            return leaf
        if not leaf.flags.writeable:
            # torch.from_numpy shares memory and would let torch write into a read-only buffer.
            leaf = leaf.copy()
        return torch.from_numpy(np.ascontiguousarray(leaf))
    if isinstance(leaf, np.generic) and not isinstance(leaf, np.bytes_ | np.str_ | np.void):
        return torch.from_numpy(np.asarray(leaf))
    if isinstance(leaf, SparseTensor) and leaf.values.dtype != object:
        indices = torch.from_numpy(np.ascontiguousarray(leaf.indices.T))
        # Checked: a user-built SparseTensor with an index out of its shape would otherwise crash torch later.
        return torch.sparse_coo_tensor(indices, _to_tensor(leaf.values), leaf.shape, check_invariants=True)
    return leaf


class _TorchIterator(UnaryIterator[Any]):
    def __init__(self, input_iterator: DatasetIterator[Any], device: Any, pin_memory: bool) -> None:
        super().__init__(input_iterator)
        self._device = device
        self._pin_memory = pin_memory
        # Copies to a CUDA device run on their own stream, so they overlap the step's kernels.
        self._stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None

    def __next__(self) -> Any:
        leaves, treedef = structure.flatten(next(self._input))
        return structure.pack(treedef, [self._convert(leaf) for leaf in leaves])

    def _convert(self, leaf: Any) -> Any:
        tensor = _to_tensor(leaf)
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if self._pin_memory or self._stream is not None:
            tensor = tensor.pin_memory()
        if self._device is None or self._device.type == "cpu":
            return tensor
        if self._stream is None:
            return tensor.to(self._device)
        with torch.cuda.stream(self._stream):
            tensor = tensor.to(self._device, non_blocking=True)
        self._stream.synchronize()
        return tensor

    def get_state(self) -> State:
        return self._input.get_state()

    def set_state(self, state: State) -> None:
        self._input.set_state(state)


class _DeviceIterator(UnaryIterator[Any]):
    """Hands out elements copied ahead on a background thread; tells CUDA's allocator the consumer's stream uses
    them, so their memory is not reused by the copy stream while a step still reads it."""

    def __next__(self) -> Any:
        element = next(self._input)
        if torch.cuda.is_available():
            for leaf in structure.flatten(element)[0]:
                if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                    leaf.record_stream(torch.cuda.current_stream(leaf.device))
        return element

    def get_state(self) -> State:
        return self._input.get_state()

    def set_state(self, state: State) -> None:
        self._input.set_state(state)
