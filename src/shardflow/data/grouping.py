"""group_by_window and bucket_by_sequence_length: elements grouped by a key into windows, each reduced to a dataset."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, IterationScope, State, UnaryDataset, UnaryIterator
from shardflow.data.errors import InvalidArgumentError
from shardflow.data.sources.in_memory import ElementsDataset


def _int_scalar(value: Any, what: str) -> int:
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iu":
        return int(value)
    raise TypeError(f"{what} must return an integer scalar, got {type(value).__name__} {np.shape(value)}")


class GroupByWindowDataset(UnaryDataset[Any]):
    """Elements go to the window of their `key_func` key; a window that reaches its size (`window_size`, or
    `window_size_func(key)`) is passed with its key to `reduce_func`, whose dataset's elements are the output. At the
    end of the input the windows still open are reduced in ascending key order, as tf.data does."""

    def __init__(
        self,
        input_dataset: Dataset[Any],
        key_func: Callable[..., Any],
        reduce_func: Callable[[Any, Dataset[Any]], Dataset[Any]],
        window_size: int | None,
        window_size_func: Callable[[Any], Any] | None,
    ) -> None:
        super().__init__(input_dataset)
        if (window_size is None) == (window_size_func is None):
            raise ValueError("group_by_window needs exactly one of window_size and window_size_func")
        for name, func in (("key_func", key_func), ("reduce_func", reduce_func)):
            if not callable(func):
                raise TypeError(f"group_by_window expects a callable {name}, got {type(func).__name__}")
        self._key_func = key_func
        self._reduce_func = reduce_func
        self._window_size_func = window_size_func
        self._window_size = None if window_size is None else self._check_size(window_size)

    @staticmethod
    def _check_size(value: Any) -> int:
        size = _int_scalar(value, "group_by_window window_size (or window_size_func)")
        if size < 1:
            raise InvalidArgumentError(f"group_by_window window size must be greater than zero, got {size}")
        return size

    def _key(self, element: Any) -> int:
        return _int_scalar(structure.call_with_element(self._key_func, element), "group_by_window key_func")

    def _size(self, key: int) -> int:
        if self._window_size is not None:
            return self._window_size
        assert self._window_size_func is not None
        return self._check_size(self._window_size_func(np.int64(key)))

    def _reduce(self, key: int, window: list[Any]) -> Dataset[Any]:
        reduced = self._reduce_func(np.int64(key), ElementsDataset(window))
        if not isinstance(reduced, Dataset):
            raise TypeError(f"group_by_window reduce_func must return a Dataset, got {type(reduced).__name__}")
        return reduced

    def _iterator(self) -> DatasetIterator[Any]:
        return _GroupByWindowIterator(iter(self._input), self)


class _GroupByWindowIterator(UnaryIterator[Any]):
    """The open windows hold data, not positions: the state is the pass's start, the number of input elements read
    and of windows flushed at the end, and the state of the current window's output. A restore reads those
    elements again (calling key_func, not reduce_func) to rebuild the windows."""

    def __init__(self, input_iterator: DatasetIterator[Any], dataset: GroupByWindowDataset) -> None:
        super().__init__(input_iterator)
        self._dataset = dataset
        self._scope = IterationScope()
        self._start = input_iterator.get_state()
        self._num_read = 0
        self._windows: dict[int, list[Any]] = {}
        self._sizes: dict[int, int] = {}
        self._flush_keys: list[int] | None = None  # set at the end of the input
        self._num_flushed = 0
        self._output: DatasetIterator[Any] | None = None

    def __next__(self) -> Any:
        while True:
            if self._output is not None:
                try:
                    return next(self._output)
                except StopIteration:
                    self._output.close()
                    self._output = None
            key, window = self._next_window()
            self._output = self._scope.iter(self._dataset._reduce(key, window))

    def _next_window(self) -> tuple[int, list[Any]]:
        while self._flush_keys is None:
            try:
                element = next(self._input)
            except StopIteration:
                self._flush_keys = sorted(self._windows)
                break
            except Exception:
                self._num_read += 1  # the input moved past the failing element
                raise
            self._num_read += 1
            full = self._add(element)
            if full is not None:
                return full
        if self._num_flushed == len(self._flush_keys):
            raise StopIteration
        key = self._flush_keys[self._num_flushed]
        self._num_flushed += 1
        return key, self._windows.pop(key)

    def _add(self, element: Any) -> tuple[int, list[Any]] | None:
        """Puts `element` in its window; returns the window if that made it full."""
        key = self._dataset._key(element)
        window = self._windows.setdefault(key, [])
        if not window:
            self._sizes[key] = self._dataset._size(key)
        window.append(element)
        if len(window) < self._sizes[key]:
            return None
        del self._windows[key]
        return key, window

    def get_state(self) -> State:
        return {
            "start": self._start,
            "num_read": self._num_read,
            "num_flushed": None if self._flush_keys is None else self._num_flushed,
            "output": None if self._output is None else self._output.get_state(),
        }

    def set_state(self, state: State) -> None:
        if self._output is not None:
            self._output.close()
            self._output = None
        self._input.set_state(state["start"])
        self._windows, self._sizes, self._flush_keys, self._num_flushed = {}, {}, None, 0
        self._num_read = int(state["num_read"])
        last: tuple[int, list[Any]] | None = None
        for _ in range(self._num_read):
            try:
                last = self._add(next(self._input)) or last
            except StopIteration:
                break
            except Exception:
                continue  # it raised in the saved pass too, where it was counted as read
        if state["num_flushed"] is not None:
            self._flush_keys = sorted(self._windows)
            for _ in range(int(state["num_flushed"])):
                last = self._next_window()
        if state["output"] is not None:
            assert last is not None, "a saved output must come from a window this replay rebuilt"
            self._output = self._scope.iter(self._dataset._reduce(*last))
            self._output.set_state(state["output"])


def bucket_by_sequence_length(
    dataset: Dataset[Any],
    element_length_func: Callable[..., Any],
    bucket_boundaries: list[int],
    bucket_batch_sizes: list[int],
    padded_shapes: Any,
    padding_values: Any,
    pad_to_bucket_boundary: bool,
    no_padding: bool,
    drop_remainder: bool,
) -> Dataset[Any]:
    """Elements whose length is in [boundaries[i-1], boundaries[i]) are batched together, `bucket_batch_sizes[i]` at a
    time, padded to the longest in the batch (or to boundaries[i] - 1 with `pad_to_bucket_boundary`). Without
    `padded_shapes` every dimension counts as unknown, as for a generator's None dimensions, and is padded."""
    boundaries = [int(boundary) for boundary in bucket_boundaries]
    batch_sizes = [int(size) for size in bucket_batch_sizes]
    if len(batch_sizes) != len(boundaries) + 1:
        raise ValueError(
            f"bucket_by_sequence_length needs len(bucket_batch_sizes) == len(bucket_boundaries) + 1, "
            f"got {len(batch_sizes)} and {len(boundaries)}"
        )
    if boundaries != sorted(boundaries):
        raise ValueError(f"bucket_by_sequence_length bucket_boundaries must be sorted, got {boundaries}")

    def bucket_of(*element: Any) -> int:
        length = _int_scalar(element_length_func(*element), "bucket_by_sequence_length element_length_func")
        return bisect.bisect_right(boundaries, length)

    def batch_window(bucket: Any, window: Dataset[Any]) -> Dataset[Any]:
        batch_size = batch_sizes[int(bucket)]
        if no_padding:
            return window.batch(batch_size, drop_remainder=drop_remainder)
        shapes = padded_shapes
        if pad_to_bucket_boundary:
            if int(bucket) == len(boundaries):
                raise ValueError(
                    "bucket_by_sequence_length: with pad_to_bucket_boundary=True, elements must have length < "
                    f"max(bucket_boundaries) = {boundaries[-1]}"
                )
            shapes = _fill_unknown(window, padded_shapes, boundaries[int(bucket)] - 1)
        return window.padded_batch(batch_size, shapes, padding_values, drop_remainder=drop_remainder)

    return GroupByWindowDataset(dataset, bucket_of, batch_window, None, lambda bucket: batch_sizes[int(bucket)])


def _fill_unknown(window: Dataset[Any], padded_shapes: Any, size: int) -> Any:
    """`padded_shapes` with its unknown dimensions (None, -1; all of them if not given) set to `size`."""
    first = next(iter(window))
    leaves, treedef = structure.flatten(first)
    if padded_shapes is None:
        shapes: list[Any] = [[None] * np.ndim(leaf) if not isinstance(leaf, bytes) else [] for leaf in leaves]
    else:
        shapes = structure.flatten_up_to(treedef, padded_shapes, "bucket_by_sequence_length padded_shapes")
    filled = [[size if dim in (None, -1) else dim for dim in shape] for shape in shapes]
    return structure.pack(treedef, filled)
