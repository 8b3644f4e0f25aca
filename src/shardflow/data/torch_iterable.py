"""as_torch(): a pipeline handed to torch as an IterableDataset. In a DataLoader each worker process reads its own
share, and the dataset and its iterators speak torch's Stateful protocol (state_dict / load_state_dict), which
StatefulDataLoader and torch.distributed.checkpoint hold."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryIterator, iter_epoch
from shardflow.data.sharding import auto_shard
from shardflow.data.torch_edge import TorchDataset


class TorchIterable(torch.utils.data.IterableDataset[Any]):
    """`dataset` for torch: elements converted by to_torch(), and copied ahead to `device` if given.

    In DataLoader worker process k of n, an iterator reads share k of n of the pipeline, cut by the pipeline's
    auto-shard policy as for training workers: whole files where it reads files by name, else every n-th element.
    So a DataLoader reads every element once per epoch, whatever its num_workers.

    Unlike a shardflow Dataset this object holds state, as torch's datasets do: the epoch given to `set_epoch`, and a
    position (`state_dict` / `load_state_dict`) for a loop that holds the dataset rather than its iterator."""

    def __init__(self, dataset: Dataset[Any], device: Any = None, pin_memory: bool = False) -> None:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"TorchIterable expects a shardflow.data.Dataset, got {type(dataset).__name__}")
        self._dataset = dataset
        self._device = device
        self._pin_memory = pin_memory
        self._epoch: int | None = None
        self._resume_from: dict[str, Any] | None = None
        self._latest: TorchIterator | None = None

    def set_epoch(self, epoch: int) -> None:
        """The pass number that shuffles in the pipeline use from the next iterator on, as DistributedSampler's
        set_epoch. Without it each iterator of this object is the next pass, but DataLoader worker processes start
        from a fresh copy of it every epoch (unless persistent_workers=True), so a seeded shuffle repeats its order."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch expects a non-negative int, got {epoch!r}")
        self._epoch = epoch

    def __iter__(self) -> TorchIterator:
        worker = torch.utils.data.get_worker_info()
        num_workers, worker_index = (1, 0) if worker is None else (worker.num_workers, worker.id)
        copies_to_device = self._device is not None and torch.device(self._device).type != "cpu"
        if worker is not None and (copies_to_device or self._pin_memory):
            raise ValueError(
                "as_torch(device=..., pin_memory=True) cannot copy from DataLoader worker processes; leave them "
                "unset, pass pin_memory=True to the DataLoader and move each batch to the device in the training loop"
            )
        share = TorchDataset(auto_shard(self._dataset, num_workers, worker_index), self._device, self._pin_memory)
        iterator = TorchIterator(
            iter(share) if self._epoch is None else iter_epoch(share, self._epoch), num_workers, worker_index
        )
        if self._resume_from is not None:
            try:
                iterator.load_state_dict(self._resume_from)
            except BaseException:
                iterator.close()
                raise
            self._resume_from = None
        self._latest = iterator
        return iterator

    def state_dict(self) -> dict[str, Any]:
        """The position of the iterator handed out last ({} before any)."""
        if self._latest is not None:
            return self._latest.state_dict()
        return dict(self._resume_from or {})

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The next iterator continues from `state_dict` ({}: from the start)."""
        self._resume_from = dict(state_dict) or None
        self._latest = None

    def __getstate__(self) -> dict[str, Any]:
        # A live iterator (threads, open files) neither pickles for spawned DataLoader workers nor belongs to a copy.
        return {**self.__dict__, "_latest": None}


class TorchIterator(UnaryIterator[Any]):
    """An iterator of a TorchIterable: shardflow's get_state() / set_state(), and the same position as torch's
    state_dict() / load_state_dict().

    state_dict() holds the position as one JSON string beside the worker's identity: primitives only, so that
    torch.load(weights_only=True) reads it, and always the same keys, so that torch.distributed.checkpoint, which
    loads key by key into a fresh iterator's state_dict, finds them all (a nested position changes shape as the
    pipeline moves)."""

    def __init__(self, input_iterator: DatasetIterator[Any], num_workers: int, worker_index: int) -> None:
        super().__init__(input_iterator)
        self._num_workers = num_workers
        self._worker_index = worker_index
        # The position last loaded, until an element is read: StatefulDataLoader restores the dataset and then its
        # iterator to the same position, and restoring a shuffle buffer twice would read it twice.
        self._loaded: str | None = None

    def __next__(self) -> Any:
        self._loaded = None
        return next(self._input)

    def get_state(self) -> State:
        return self._input.get_state()

    def set_state(self, state: State) -> None:
        self._loaded = None
        self._input.set_state(state)

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_workers": self._num_workers,
            "worker_index": self._worker_index,
            "position": json.dumps(self.get_state()),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        position = state_dict.get("position") if isinstance(state_dict, Mapping) else None
        if not isinstance(position, str):
            raise ValueError(
                "load_state_dict expects what state_dict() of an as_torch() dataset or iterator returned "
                f"(num_workers, worker_index, position), got {state_dict!r:.200}"
            )
        saved_in = (state_dict.get("num_workers"), state_dict.get("worker_index"))
        if saved_in != (self._num_workers, self._worker_index):
            raise ValueError(
                f"this position was saved in {_process_name(*saved_in)} and restores only there, over the same "
                f"pipeline; this iterator runs in {_process_name(self._num_workers, self._worker_index)}"
            )
        if position != self._loaded:
            self._input.set_state(json.loads(position))
            self._loaded = position


def _process_name(num_workers: Any, worker_index: Any) -> str:
    if num_workers == 1:
        return "a single process (DataLoader num_workers=0 or 1)"
    return f"DataLoader worker {worker_index} of num_workers={num_workers}"
