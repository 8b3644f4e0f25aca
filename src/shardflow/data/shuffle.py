"""shuffle(buffer_size) as a windowed shuffle whose state is a position, not the buffered elements."""

from __future__ import annotations

import itertools
import secrets
from typing import Any, TypeVar

import numpy as np

from shardflow.data.dataset import (
    Dataset,
    DatasetIterator,
    State,
    UnaryDataset,
    UnaryIterator,
    current_epochs,
    has_bulk_next,
)
from shardflow.data.errors import InvalidArgumentError

T = TypeVar("T")

_SEED_MASK = (1 << 63) - 1


class _Raised:
    """An upstream error kept at its place in the window, raised when the permutation reaches it."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class ShuffleDataset(UnaryDataset[T]):
    """A windowed shuffle: the input is cut into windows of `buffer_size` elements, and each window is permuted
    with a generator seeded by (seed, epoch, window index) and emitted. The state is the input's state at the
    window's start, the window index and the position in it, so a restore re-reads the window and permutes it
    again, as Grain does. Unlike tf.data's sliding buffer an element never leaves its window: the same mixing within
    a window and none across windows."""

    def __init__(
        self, input_dataset: Dataset[T], buffer_size: int, seed: int | None, reshuffle_each_iteration: bool
    ) -> None:
        super().__init__(input_dataset)
        if not isinstance(buffer_size, int | np.integer) or buffer_size < 1:
            raise InvalidArgumentError(f"shuffle buffer_size must be a positive int, got {buffer_size!r}")
        self._buffer_size = int(buffer_size)
        # seed=None draws one seed per dataset; the state records it, so a restore needs no global seed.
        self._seed = secrets.randbits(63) if seed is None else int(seed) & _SEED_MASK
        self._reshuffle = reshuffle_each_iteration
        self._passes = itertools.count()

    def _iterator(self) -> DatasetIterator[T]:
        # Under repeat, the pass number is the repeat's epoch (which a restore reproduces); otherwise each
        # iter() of this dataset is a new pass, as with tf.data's reshuffle_each_iteration.
        epochs = current_epochs() or (next(self._passes),)
        return _ShuffleIterator(iter(self._input), self._buffer_size, self._seed, epochs if self._reshuffle else ())

    def _cardinality(self) -> int:
        return self._input._cardinality()

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


class _ShuffleIterator(UnaryIterator[T]):
    def __init__(
        self, input_iterator: DatasetIterator[T], buffer_size: int, seed: int, epochs: tuple[int, ...]
    ) -> None:
        super().__init__(input_iterator)
        self._buffer_size = buffer_size
        self._seed = seed
        self._epochs = epochs
        self._window: list[Any] = []  # already in shuffled order
        self._raised: list[int] = []  # where in the window errors sit, descending
        self._window_index = 0
        self._position = 0
        # The input's state where the current window starts; None while no window is open.
        self._window_start: State | None = None
        self._exhausted = False

    def __next__(self) -> T:
        if self._window_start is None:
            self._fill()
        element = self._window[self._position]
        self._window[self._position] = None  # let the consumer own the only reference
        self._advance(1)
        if isinstance(element, _Raised):
            self._raised.pop()
            raise element.error
        return element  # type: ignore[no-any-return]

    def next_many(self, max_count: int) -> list[T]:
        if self._window_start is None:
            self._fill()
        start = self._position
        end = min(start + max_count, len(self._window))
        if self._raised and self._raised[-1] < end:
            if self._raised[-1] == start:
                return [next(self)]  # raises
            end = self._raised[-1]
        elements = self._window[start:end]
        self._advance(end - start)
        return elements

    def _advance(self, count: int) -> None:
        self._position += count
        if self._position == len(self._window):
            self._window, self._window_start = [], None
            self._window_index += 1
            self._position = 0

    def _fill(self) -> None:
        if self._exhausted:
            raise StopIteration
        start = self._input.get_state()
        window: list[Any] = []
        bulk = has_bulk_next(self._input)
        num_raised = 0
        while len(window) < self._buffer_size:
            try:
                if bulk:
                    window += self._input.next_many(self._buffer_size - len(window))
                else:
                    window.append(next(self._input))
            except StopIteration:
                break
            except Exception as error:
                window.append(_Raised(error))
                num_raised += 1
        if not window:
            self._exhausted = True
            raise StopIteration
        self._exhausted = len(window) < self._buffer_size
        self._window = list(map(window.__getitem__, self._permutation(len(window))))
        raised = (
            [index for index, element in enumerate(self._window) if isinstance(element, _Raised)] if num_raised else []
        )
        self._raised = raised[::-1]
        self._window_start = start

    def _permutation(self, size: int) -> list[int]:
        entropy = [self._seed, *self._epochs, self._window_index]
        return np.random.Generator(np.random.PCG64(entropy)).permutation(size).tolist()  # type: ignore[no-any-return]

    def get_state(self) -> State:
        return {
            "input": self._input.get_state() if self._window_start is None else self._window_start,
            "window": self._window_index,
            "position": self._position,
            "seed": self._seed,
            "epochs": list(self._epochs),
        }

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._seed = int(state["seed"])
        self._epochs = tuple(state["epochs"])
        self._window_index = int(state["window"])
        self._window, self._raised, self._window_start, self._exhausted = [], [], None, False
        self._position = 0
        position = int(state["position"])
        if position:
            self._fill()
            self._position = position
            self._raised = [index for index in self._raised if index >= position]
