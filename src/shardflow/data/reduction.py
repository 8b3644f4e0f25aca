"""Consumers that iterate a dataset and return a value: reduce and get_single_element."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from shardflow.data.dataset import Dataset, has_bulk_next
from shardflow.data.errors import InvalidArgumentError
from shardflow.data.scan import StateSignature

T = TypeVar("T")

_BULK_ELEMENTS = 1024


def reduce(dataset: Dataset[Any], initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
    """The state after `reduce_func(state, element)` over every element, keeping the initial state's structure and
    dtypes (as tf.data requires)."""
    if not callable(reduce_func):
        raise TypeError(f"reduce expects a callable reduce_func, got {type(reduce_func).__name__}")
    signature = StateSignature(initial_state, "reduce")
    state = signature.initial
    iterator = iter(dataset)
    try:
        if has_bulk_next(iterator):
            while True:
                try:
                    elements = iterator.next_many(_BULK_ELEMENTS)
                except StopIteration:
                    break
                for element in elements:
                    state = signature.check(reduce_func(state, element))
        else:
            for element in iterator:
                state = signature.check(reduce_func(state, element))
    finally:
        iterator.close()
    return state


def get_single_element(dataset: Dataset[T]) -> T:
    """The dataset's only element; InvalidArgumentError (a ValueError) if it has none or more than one."""
    iterator = iter(dataset)
    try:
        try:
            element = next(iterator)
        except StopIteration:
            raise InvalidArgumentError(
                "get_single_element: the dataset was empty; it must have exactly one element"
            ) from None
        try:
            next(iterator)
        except StopIteration:
            return element
        raise InvalidArgumentError(
            "get_single_element: the dataset had more than one element; it must have exactly one"
        )
    finally:
        iterator.close()
