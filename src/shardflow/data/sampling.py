"""sample_from_datasets and choose_from_datasets: each element comes from the input that random weights, or a
dataset of choices, select."""

from __future__ import annotations

import bisect
import copy
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.dataset import Dataset, DatasetIterator, State, current_epochs, has_bulk_next, replay
from shardflow.data.errors import InvalidArgumentError
from shardflow.data.randomness import RandomStream, resolve_seed

# Mixed into the random stream's seed, so that another op given the same seed draws other numbers.
_STREAM_TAG = 0x5A3F


def check_datasets(datasets: Any, operation: str) -> list[Dataset[Any]]:
    if not isinstance(datasets, Sequence) or isinstance(datasets, str | bytes) or not datasets:
        raise ValueError(f"{operation} needs a non-empty list of datasets, got {datasets!r:.80}")
    for dataset in datasets:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"{operation} takes shardflow.data.Dataset inputs, got {type(dataset).__name__}")
    return list(datasets)


def _check_weights(weights: Any, num_datasets: int, where: str) -> npt.NDArray[np.float64]:
    array = np.asarray(weights, dtype=np.float64)
    if array.shape != (num_datasets,):
        raise ValueError(f"{where} must hold one weight per dataset ({num_datasets}), got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{where} must be finite and non-negative, got {array.tolist()}")
    return array


def _cumulative(weights: npt.NDArray[np.float64]) -> npt.NDArray[np.float64] | None:
    """Cumulative weights, or None if none is positive."""
    return np.cumsum(weights) if weights.sum() > 0 else None


def _pick(cumulative: npt.NDArray[np.float64], uniform: Any) -> Any:
    """The index (or indices) whose cumulative-weight interval holds `uniform` (in [0, 1)) times the total."""
    # side="right" never lands on a zero weight; the clip guards a product that rounds up to the total.
    picks = np.searchsorted(cumulative, uniform * cumulative[-1], side="right")
    return np.minimum(picks, np.searchsorted(cumulative, cumulative[-1], side="left"))


class DirectedDataset(Dataset[Any]):
    """Elements of `datasets` in the order a selector names them: random draws with `weights` (a list, or a dataset
    of weight vectors, one per draw), or the indices of `choice_dataset`. An input that is empty when selected ends
    the whole dataset with `stop_on_empty_dataset`, else it is left out of later draws (its weight share goes to the
    others; a choice of it is skipped)."""

    def __init__(
        self,
        datasets: list[Dataset[Any]],
        stop_on_empty_dataset: bool,
        *,
        weights: Any = None,
        choice_dataset: Dataset[Any] | None = None,
        seed: int | None = None,
        rerandomize_each_iteration: bool | None = None,
    ) -> None:
        self._datasets = datasets
        self._stop_on_empty = bool(stop_on_empty_dataset)
        self._choice_dataset = choice_dataset
        self._weights_dataset = weights if isinstance(weights, Dataset) else None
        self._weights: npt.NDArray[np.float64] | None = None
        if choice_dataset is None and self._weights_dataset is None:
            uniform = np.ones(len(datasets))
            self._weights = uniform if weights is None else _check_weights(weights, len(datasets), "weights")
        # As in tf.data, seed=None draws one seed for this dataset: each pass repeats it unless rerandomized.
        self._seed = resolve_seed(seed)
        self._rerandomize = bool(rerandomize_each_iteration)
        self._passes = itertools.count()

    def _inputs(self) -> tuple[Dataset[Any], ...]:
        return tuple(self._datasets)

    def _with_inputs(self, inputs: tuple[Dataset[Any], ...]) -> Dataset[Any]:
        clone = copy.copy(self)
        clone._datasets = list(inputs)
        return clone

    def _iterator(self) -> DatasetIterator[Any]:
        epochs = (current_epochs() or (next(self._passes),)) if self._rerandomize else ()
        selector = self._choice_dataset if self._choice_dataset is not None else self._weights_dataset
        return _DirectedIterator(
            [iter(dataset) for dataset in self._datasets],
            None if selector is None else iter(selector),
            self,
            (self._seed, *epochs),
        )

    def _cardinality(self) -> int:
        # Infinite if an input is, whatever the choices or stop_on_empty_dataset say (tf.data's rule), else unknown.
        counts = [dataset._cardinality() for dataset in self._datasets]
        return INFINITE_CARDINALITY if INFINITE_CARDINALITY in counts else UNKNOWN_CARDINALITY


class _Buffered:
    """One input and the elements read ahead from it for a bulk draw. Its position is `anchor` (the iterator's state
    before `buffer`) plus the `position` elements of `buffer` already used; `pending` is what the iterator raised
    after `buffer`, raised when the draws reach it."""

    __slots__ = ("anchor", "buffer", "iterator", "pending", "position")

    def __init__(self, iterator: DatasetIterator[Any]) -> None:
        self.iterator = iterator
        self.buffer: list[Any] = []
        self.position = 0
        self.anchor: State | None = None
        self.pending: BaseException | None = None

    def next(self) -> Any:
        if self.position < len(self.buffer):
            self.position += 1
            return self.buffer[self.position - 1]
        if self.pending is not None:
            error, self.pending = self.pending, None
            raise error
        return next(self.iterator)

    def fill(self, count: int) -> int:
        """Reads ahead until `count` elements are available or the input ends or fails; returns how many are."""
        available = len(self.buffer) - self.position
        if available >= count or self.pending is not None:
            return available
        if not available:
            self.buffer, self.position, self.anchor = [], 0, self.iterator.get_state()
        bulk = has_bulk_next(self.iterator)
        try:
            while len(self.buffer) - self.position < count:
                if bulk:
                    self.buffer += self.iterator.next_many(count - len(self.buffer) + self.position)
                else:
                    self.buffer.append(next(self.iterator))
        except Exception as error:  # StopIteration included: kept until a draw reaches it
            self.pending = error
        return len(self.buffer) - self.position

    def take(self, count: int) -> list[Any]:
        self.position += count
        return self.buffer[self.position - count : self.position]

    def state(self) -> State:
        if self.pending is None and self.position == len(self.buffer):
            return {"state": self.iterator.get_state(), "skip": 0}
        return {"state": self.anchor, "skip": self.position}

    def restore(self, saved: State) -> None:
        self.buffer, self.position, self.anchor, self.pending = [], 0, None, None
        self.iterator.set_state(saved["state"])
        replay(self.iterator, int(saved["skip"]))


class _DirectedIterator(DatasetIterator[Any]):
    """State: each input's position, which inputs are exhausted, the selector's state and the number of random
    words used."""

    def __init__(
        self,
        inputs: list[DatasetIterator[Any]],
        selector: DatasetIterator[Any] | None,
        dataset: DirectedDataset,
        entropy: tuple[int, ...],
    ) -> None:
        self._inputs = [_Buffered(iterator) for iterator in inputs]
        self._selector = selector
        self._weights = dataset._weights
        self._random = dataset._choice_dataset is None
        self._stream = RandomStream((_STREAM_TAG, *entropy))
        self._stop_on_empty = dataset._stop_on_empty
        self._exhausted = [False] * len(inputs)
        self._done = False
        self._cumulative: npt.NDArray[np.float64] | None = None
        self._bounds: list[float] = []
        self._last_positive = 0
        self._update_weights()

    def _update_weights(self) -> None:
        """Cumulative weights of the inputs not yet exhausted; None when none of them has weight left."""
        if self._weights is not None:
            self._cumulative = _cumulative(np.where(self._exhausted, 0.0, self._weights))
            if self._cumulative is not None:
                # The same as Python floats, for draws one at a time without numpy calls.
                self._bounds = self._cumulative.tolist()
                self._last_positive = int(np.searchsorted(self._cumulative, self._cumulative[-1], side="left"))

    def _choose(self) -> int:
        """The input the next draw names; StopIteration when the selector ends or no input has weight left."""
        if self._weights is not None:
            if self._cumulative is None:
                raise StopIteration
            # As _pick does, with bisect on Python floats.
            picked = bisect.bisect_right(self._bounds, self._stream.uniform() * self._bounds[-1])
            return min(picked, self._last_positive)
        assert self._selector is not None
        selected = next(self._selector)
        if self._random:
            weights = _check_weights(selected, len(self._inputs), "an element of the weights dataset")
            cumulative = _cumulative(np.where(self._exhausted, 0.0, weights))
            if cumulative is None:
                raise StopIteration  # no input this draw could name has elements left
            return int(_pick(cumulative, self._stream.uniform()))
        if not isinstance(selected, np.int64 | np.ndarray) or np.shape(selected) or selected.dtype != np.int64:
            raise TypeError(
                "choose_from_datasets: elements of choice_dataset must be int64 scalars, got "
                f"{type(selected).__name__} {getattr(selected, 'dtype', '')} {np.shape(selected)}"
            )
        if not 0 <= selected < len(self._inputs):
            raise InvalidArgumentError(
                f"choose_from_datasets: choice {int(selected)} is out of range for {len(self._inputs)} datasets"
            )
        return int(selected)

    def __next__(self) -> Any:
        while not self._done:
            index = self._choose()
            if self._exhausted[index]:
                continue  # a choice (or a drawn weight vector) naming an exhausted input is skipped
            try:
                return self._inputs[index].next()
            except StopIteration:
                self._end_of_input(index)
        raise StopIteration

    def _end_of_input(self, index: int) -> None:
        self._exhausted[index] = True
        self._done = self._stop_on_empty or all(self._exhausted)
        self._update_weights()

    def next_many(self, max_count: int) -> list[Any]:
        # Bulk draws only with fixed weights over inputs that replay exactly (read-ahead needs a restore to replay).
        if self._weights is None or not all(place.iterator.deterministic for place in self._inputs):
            return [next(self)]
        out: list[Any] = []
        while len(out) < max_count and not self._done and self._cumulative is not None:
            count = max_count - len(out)
            picks = _pick(self._cumulative, self._stream.peek_uniform(count))
            wanted = np.bincount(picks, minlength=len(self._inputs))
            available = np.array(
                [place.fill(int(need)) if need else 0 for place, need in zip(self._inputs, wanted, strict=True)]
            )
            # The draw at which some input runs short: everything before it is served from the buffers.
            order = np.argsort(picks, kind="stable")
            occurrence = np.empty(count, dtype=np.int64)
            occurrence[order] = np.arange(count) - np.searchsorted(picks[order], picks[order], side="left")
            short = np.flatnonzero(occurrence >= available[picks])
            served = int(short[0]) if short.size else count
            used = np.bincount(picks[:served], minlength=len(self._inputs))
            sources = [iter(place.take(int(num_used))) for place, num_used in zip(self._inputs, used, strict=True)]
            out += map(next, map(sources.__getitem__, picks[:served].tolist()))
            self._stream.advance(served)
            if served == count:
                break
            # The input named by draw `served` has ended or failed: that draw is used up either way.
            index = int(picks[served])
            if not isinstance(self._inputs[index].pending, StopIteration):
                if out:
                    break  # the next call takes the failing draw and raises its error
                self._stream.advance(1)
                self._inputs[index].next()  # raises the input's error
            self._stream.advance(1)
            self._inputs[index].pending = None
            self._end_of_input(index)
        if not out:
            raise StopIteration
        return out

    @property
    def deterministic(self) -> bool:
        iterators = [place.iterator for place in self._inputs] + ([self._selector] if self._selector else [])
        return all(iterator.deterministic for iterator in iterators)

    def get_state(self) -> State:
        return {
            "inputs": [
                None if done else place.state() for place, done in zip(self._inputs, self._exhausted, strict=True)
            ],
            "selector": None if self._selector is None else self._selector.get_state(),
            "entropy": list(self._stream.entropy),
            "random": self._stream.position,
            "done": self._done,
        }

    def set_state(self, state: State) -> None:
        self._exhausted = [saved is None for saved in state["inputs"]]
        for place, saved in zip(self._inputs, state["inputs"], strict=True):
            if saved is not None:
                place.restore(saved)
        if self._selector is not None:
            self._selector.set_state(state["selector"])
        self._stream = RandomStream(tuple(state["entropy"]))
        self._stream.position = int(state["random"])
        self._done = bool(state["done"])
        self._update_weights()

    def close(self) -> None:
        for place in self._inputs:
            place.iterator.close()
        if self._selector is not None:
            self._selector.close()
