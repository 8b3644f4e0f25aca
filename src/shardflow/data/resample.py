"""rejection_resample: (class, element) pairs whose classes follow a target distribution."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator
from shardflow.data.randomness import RandomStream, resolve_seed

# Mixed into the random stream's seed, so that another op given the same seed draws other numbers.
_STREAM_TAG = 0x2E5A

Distribution = npt.NDArray[np.float64]


def _distribution(value: Any, argument: str, num_classes: int | None = None) -> Distribution:
    array = np.asarray(value, dtype=np.float64)
    if array.ndim != 1 or not array.size or (num_classes is not None and array.size != num_classes):
        expected = f"{num_classes} classes" if num_classes is not None else "one probability per class"
        raise ValueError(f"rejection_resample {argument} must be a vector with {expected}, got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0) or not array.sum() > 0:
        raise ValueError(
            f"rejection_resample {argument} must be non-negative with a positive sum, got {array.tolist()}"
        )
    # tf.data does not insist on a sum of 1 either; only the proportions matter.
    normalized: Distribution = array / array.sum()
    return normalized


def acceptance(initial: Distribution, target: Distribution) -> Distribution:
    """The probability of keeping an element of each class so that the kept ones follow `target` when the input's
    follow `initial`: proportional to target / initial, and 1 for the class where that ratio is largest (no scheme
    that keeps each element at most once keeps more)."""
    present = initial > 0
    ratio = np.divide(target, initial, out=np.zeros_like(target), where=present)
    largest = float(ratio.max())
    # A class the initial distribution says never occurs is kept whenever the target wants it at all.
    return np.where(present, ratio / largest if largest > 0 else 0.0, (target > 0).astype(np.float64))


class RejectionResampleDataset(UnaryDataset[Any]):
    """Each element is kept or dropped on its own, by its class; without `initial_dist` the input's class
    distribution is estimated from the classes read so far, this element's included. Unlike tf.data, which mixes
    in a second pass over the input (so an element can come out twice), each element comes out at most once, which
    also keeps the classes on target whatever order the input has."""

    def __init__(
        self,
        input_dataset: Dataset[Any],
        class_func: Callable[..., Any],
        target_dist: Any,
        initial_dist: Any,
        seed: int | None,
    ) -> None:
        super().__init__(input_dataset)
        if not callable(class_func):
            raise TypeError(f"rejection_resample expects a callable class_func, got {type(class_func).__name__}")
        self._class_func = class_func
        self._target = _distribution(target_dist, "target_dist")
        self._initial = None if initial_dist is None else _distribution(initial_dist, "initial_dist", self._target.size)
        self._seed = resolve_seed(seed)

    def _class_of(self, element: Any) -> Any:
        value = structure.normalize(structure.call_with_element(self._class_func, element))
        if not isinstance(value, np.integer) or not 0 <= value < self._target.size:
            raise ValueError(
                f"rejection_resample class_func must return an integer scalar in [0, {self._target.size}), "
                f"got {value!r:.40}"
            )
        return value

    def _iterator(self) -> DatasetIterator[Any]:
        return _ResampleIterator(iter(self._input), self)


class _ResampleIterator(UnaryIterator[Any]):
    """State: the input's state, the number of random draws, and the class counts behind the estimate."""

    def __init__(self, input_iterator: DatasetIterator[Any], dataset: RejectionResampleDataset) -> None:
        super().__init__(input_iterator)
        self._dataset = dataset
        self._stream = RandomStream((_STREAM_TAG, dataset._seed))
        self._counts = np.zeros(dataset._target.size, dtype=np.int64)
        self._fixed = None if dataset._initial is None else acceptance(dataset._initial, dataset._target)

    def __next__(self) -> Any:
        while True:
            element = next(self._input)
            label = self._dataset._class_of(element)
            self._counts[label] += 1
            keep = self._fixed
            if keep is None:
                keep = acceptance(self._counts / self._counts.sum(), self._dataset._target)
            if keep[label] >= 1.0 or self._stream.uniform() < keep[label]:
                return label, element

    def get_state(self) -> State:
        return {"input": self._input.get_state(), "random": self._stream.position, "counts": self._counts.tolist()}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._stream.position = int(state["random"])
        self._counts = np.asarray(state["counts"], dtype=np.int64)
