"""The iterator contract every source and transformation implements (a pass that says where it is and can be
restored there), and the scope an iterator is built in: the pipeline's options and the enclosing repeats' epochs."""

from __future__ import annotations

import abc
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from shardflow.data.errors import OutOfRangeError
from shardflow.data.optional import Optional

if TYPE_CHECKING:
    from shardflow.data.dataset import Dataset
    from shardflow.data.options import Options

T = TypeVar("T")

State = dict[str, Any]
"""An iterator's position: small, JSON-serializable, made of positions and seeds, never buffered data."""

# The merged options of the pipeline being iterated, seen by every iterator built inside the outermost `iter()`.
_ACTIVE_OPTIONS: contextvars.ContextVar[Options | None] = contextvars.ContextVar("shardflow_data_options", default=None)
# The epoch numbers of the enclosing repeats while they build a new pass, so that shuffles reshuffle per epoch.
_EPOCHS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("shardflow_data_epochs", default=None)


class DatasetIterator(abc.ABC, Iterator[T], Generic[T]):
    """One pass over a dataset. `get_state()` says where it is; `set_state()` on a fresh iterator of the
    same dataset continues with exactly the elements this one would have produced next."""

    def __iter__(self) -> DatasetIterator[T]:
        return self

    @abc.abstractmethod
    def __next__(self) -> T: ...

    @abc.abstractmethod
    def get_state(self) -> State: ...

    @abc.abstractmethod
    def set_state(self, state: State) -> None: ...

    def next_many(self, max_count: int) -> list[T]:
        """The next elements, as many `next()` calls would return them: at least one and at most `max_count`. It
        returns early before an element whose production raises, so that only a call that would return nothing
        raises (StopIteration at the end). Iterators that hold elements in lists override this to hand over a
        slice; this default returns one element, and `has_bulk_next` tells the two apart."""
        return [next(self)]

    def get_next(self) -> T:
        """The next element, as tf.data's `iterator.get_next()`: OutOfRangeError (not StopIteration) at the end."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError("End of sequence") from None

    def get_next_as_optional(self) -> Optional[T]:
        """The next element wrapped in an Optional, which is empty at the end of the data."""
        try:
            return Optional.from_value(next(self))
        except StopIteration:
            return Optional.empty()

    def close(self) -> None:
        """Release threads, processes and files. Iterators without any keep this no-op."""

    @property
    def deterministic(self) -> bool:
        """Whether a restored iterator yields the remaining elements in the same order. Stages that restore by
        re-reading their input (prefetch replays, shuffle windows, unbatch) are exact only over deterministic
        input; prefetch falls back to a state per element when this is False."""
        return True


class UnaryIterator(DatasetIterator[T]):
    """An iterator reading one input iterator, `_input`, which it closes with itself."""

    def __init__(self, input_iterator: DatasetIterator[Any]) -> None:
        self._input = input_iterator

    def close(self) -> None:
        self._input.close()

    @property
    def deterministic(self) -> bool:
        return self._input.deterministic


def start_pass(dataset: Dataset[T]) -> DatasetIterator[T]:
    """`iter(dataset)`: its iterator, built under the options of the whole pipeline when no enclosing `iter()` has
    set them already, so that every iterator of one pass sees the outermost dataset's options."""
    if _ACTIVE_OPTIONS.get() is not None:
        return dataset._iterator()
    token = _ACTIVE_OPTIONS.set(dataset.options())
    try:
        return dataset._iterator()
    finally:
        _ACTIVE_OPTIONS.reset(token)


def has_bulk_next(iterator: DatasetIterator[Any]) -> bool:
    """Whether `iterator.next_many` returns more than one element per call (rather than the default one)."""
    return type(iterator).next_many is not DatasetIterator.next_many


def replay(iterator: DatasetIterator[Any], count: int) -> None:
    """Advances `iterator` by `count` elements, counting those whose production raised, to reach a position saved
    as (state, elements after it): cheaper than a state per element for the stages that run ahead."""
    bulk = has_bulk_next(iterator)
    while count > 0:
        try:
            if bulk:
                count -= len(iterator.next_many(count))
            else:
                next(iterator)
                count -= 1
        except StopIteration:
            return
        except Exception:
            count -= 1


def active_options() -> Options:
    """The options of the pipeline whose iterator is being built (defaults outside an `iter()` call)."""
    # Here, not at the top: options imports this module.
    from shardflow.data.options import Options

    return _ACTIVE_OPTIONS.get() or Options()


def current_epochs() -> tuple[int, ...]:
    """The epoch numbers of the enclosing repeats while they build an iterator (empty outside any repeat)."""
    return _EPOCHS.get() or ()


def iter_epoch(dataset: Dataset[T], epoch: int) -> DatasetIterator[T]:
    """`iter(dataset)` as pass number `epoch`, as a repeat starts its passes: shuffles below reshuffle by the epoch
    rather than by how often this copy of the dataset was iterated."""
    token = _EPOCHS.set((*current_epochs(), epoch))
    try:
        return iter(dataset)
    finally:
        _EPOCHS.reset(token)


class IterationScope:
    """The options and enclosing epochs seen while an iterator is built, kept so that iterators it builds later
    (a repeat's next pass, an interleave's next input) see the same."""

    def __init__(self) -> None:
        self.options = active_options()
        self.epochs = current_epochs()

    def iter(self, dataset: Dataset[T], epoch: int | None = None) -> DatasetIterator[T]:
        """`iter(dataset)` in this scope, as pass number `epoch` of a repeat when given."""
        epochs = self.epochs if epoch is None else (*self.epochs, epoch)
        options_token = _ACTIVE_OPTIONS.set(self.options)
        epochs_token = _EPOCHS.set(epochs)
        try:
            return iter(dataset)
        finally:
            _EPOCHS.reset(epochs_token)
            _ACTIVE_OPTIONS.reset(options_token)
