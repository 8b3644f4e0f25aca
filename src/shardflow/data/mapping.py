"""map and filter: a user function per element, inline, on threads or in worker processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator
from shardflow.data.options import AUTOTUNE, resolve_deterministic, resolve_parallelism

T = TypeVar("T")


def apply_map(map_func: Callable[..., Any], element: Any) -> Any:
    """Calls `map_func` as tf.data does and converts what it returns to shardflow's leaves."""
    result = structure.call_with_element(map_func, element)
    if type(result) is list:
        result = tuple(result)  # a returned list is the element's components, not one array to stack (tf.data)
    if isinstance(result, bytes) or (isinstance(result, np.ndarray | np.generic) and result.dtype.kind not in "US"):
        return result  # already a leaf as shardflow keeps it: skip the walk over the structure
    return structure.normalize(result)


class MapDataset(UnaryDataset[Any]):
    def __init__(
        self,
        input_dataset: Dataset[Any],
        map_func: Callable[..., Any],
        num_parallel_calls: int | None,
        deterministic: bool | None,
        *,
        use_processes: bool,
    ) -> None:
        super().__init__(input_dataset)
        if not callable(map_func):
            raise TypeError(f"map expects a callable map_func, got {type(map_func).__name__}")
        self._map_func = map_func
        self._num_parallel_calls = AUTOTUNE if use_processes and num_parallel_calls is None else num_parallel_calls
        resolve_parallelism(self._num_parallel_calls)
        self._deterministic = deterministic
        self._use_processes = use_processes

    def _iterator(self) -> DatasetIterator[Any]:
        parallelism = resolve_parallelism(self._num_parallel_calls)
        if parallelism == 0:
            return _MapIterator(iter(self._input), self._map_func)
        deterministic = resolve_deterministic(self._deterministic)
        if self._use_processes:
            from shardflow.data.processes import ProcessMapIterator

            return ProcessMapIterator(iter(self._input), self._map_func, parallelism, deterministic)
        from shardflow.data.threads import ThreadMapIterator

        autotuned = self._num_parallel_calls == AUTOTUNE
        return ThreadMapIterator(iter(self._input), self._map_func, parallelism, deterministic, autotuned)

    def _cardinality(self) -> int:
        return self._input._cardinality()


class _MapIterator(UnaryIterator[Any]):
    def __init__(self, input_iterator: DatasetIterator[Any], map_func: Callable[..., Any]) -> None:
        super().__init__(input_iterator)
        self._map_func = map_func

    def __next__(self) -> Any:
        return apply_map(self._map_func, next(self._input))

    def get_state(self) -> State:
        return self._input.get_state()

    def set_state(self, state: State) -> None:
        self._input.set_state(state)


class FilterDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], predicate: Callable[..., Any]) -> None:
        super().__init__(input_dataset)
        if not callable(predicate):
            raise TypeError(f"filter expects a callable predicate, got {type(predicate).__name__}")
        self._predicate = predicate

    def _iterator(self) -> DatasetIterator[T]:
        return _FilterIterator(iter(self._input), self._predicate)

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


class _FilterIterator(UnaryIterator[T]):
    def __init__(self, input_iterator: DatasetIterator[T], predicate: Callable[..., Any]) -> None:
        super().__init__(input_iterator)
        self._predicate = predicate

    def __next__(self) -> T:
        while True:
            element: T = next(self._input)
            keep = structure.call_with_element(self._predicate, element)
            if isinstance(keep, bool | np.bool_):
                if keep:
                    return element
                continue
            if isinstance(keep, np.ndarray) and keep.shape == () and keep.dtype == bool:
                if keep:
                    return element
                continue
            raise TypeError(
                f"filter predicate must return a scalar bool, got {type(keep).__name__} {np.shape(keep)}; "
                "reduce it with np.all / np.any"
            )

    def get_state(self) -> State:
        return self._input.get_state()

    def set_state(self, state: State) -> None:
        self._input.set_state(state)
