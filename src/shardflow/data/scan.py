"""scan(initial_state, scan_func): a state carried from element to element, each step returning an output."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator, has_bulk_next, replay

# A carried state up to this size (as JSON) is saved in the iterator state; a larger one is rebuilt on restore by
# running scan_func again from the pass's start, so that the iterator state stays small.
_MAX_SAVED_CARRY = 384


def _leaf_type(leaf: Any) -> Any:
    return bytes if isinstance(leaf, bytes) else np.asarray(leaf).dtype


class StateSignature:
    """The structure and leaf dtypes of a carried state, which every new state must keep (as tf.data requires)."""

    def __init__(self, initial_state: Any, operation: str) -> None:
        self.initial = structure.normalize(initial_state)
        leaves, self.treedef = structure.flatten(self.initial)
        self.types = [_leaf_type(leaf) for leaf in leaves]
        self._operation = operation

    def check(self, new_state: Any) -> Any:
        """`new_state` converted to shardflow's leaves; TypeError if its structure or a dtype changed."""
        if self.treedef is None and isinstance(new_state, np.generic) and new_state.dtype == self.types[0]:
            return new_state  # the common scalar state: skip the walk over the structure
        new_state = structure.normalize(new_state)
        leaves, treedef = structure.flatten(new_state)
        if treedef != self.treedef:
            raise TypeError(
                f"{self._operation}: the new state has structure {structure.describe(treedef)}, the initial state "
                f"has {structure.describe(self.treedef)}; they must match"
            )
        for path, leaf, expected in zip(structure.leaf_paths(treedef), leaves, self.types, strict=True):
            if _leaf_type(leaf) != expected:
                where = f" {path}" if path else ""
                raise TypeError(
                    f"{self._operation}: the new state{where} has dtype {_leaf_type(leaf)}, the initial state has "
                    f"{expected}; cast it back (e.g. np.int64(...))"
                )
        return new_state

    def encode(self, value: Any) -> list[Any] | None:
        """The leaves of `value` as JSON-able lists, or None when they hold object arrays or are too large."""
        encoded: list[Any] = []
        for leaf in structure.flatten(value)[0]:
            if isinstance(leaf, bytes):
                encoded.append(base64.b64encode(leaf).decode())
                continue
            array = np.asarray(leaf)
            if array.dtype == object or array.nbytes > _MAX_SAVED_CARRY:
                return None
            encoded.append(
                [array.dtype.str, list(array.shape), array.reshape(-1).tolist(), isinstance(leaf, np.generic)]
            )
        return encoded if len(json.dumps(encoded)) <= _MAX_SAVED_CARRY else None

    def decode(self, encoded: list[Any]) -> Any:
        leaves: list[Any] = []
        for item, leaf_type in zip(encoded, self.types, strict=True):
            if leaf_type is bytes:
                leaves.append(base64.b64decode(item))
                continue
            dtype, shape, values, is_scalar = item
            array = np.asarray(values, dtype=np.dtype(dtype)).reshape(shape)
            leaves.append(array[()] if is_scalar else array)
        return structure.pack(self.treedef, leaves)


def _split_result(result: Any, operation: str) -> tuple[Any, Any]:
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(f"{operation} must return a (new_state, output_element) pair, got {type(result).__name__}")
    return result


class ScanDataset(UnaryDataset[Any]):
    def __init__(self, input_dataset: Dataset[Any], initial_state: Any, scan_func: Callable[[Any, Any], Any]) -> None:
        super().__init__(input_dataset)
        if not callable(scan_func):
            raise TypeError(f"scan expects a callable scan_func, got {type(scan_func).__name__}")
        self._signature = StateSignature(initial_state, "scan")
        self._scan_func = scan_func

    def _iterator(self) -> DatasetIterator[Any]:
        return _ScanIterator(iter(self._input), self)

    def _cardinality(self) -> int:
        return self._input._cardinality()


class _ScanIterator(UnaryIterator[Any]):
    """Reads the input ahead in bulk (`ahead`, read from the input state `anchor`). State: the input position, the
    number of elements scanned, and the carried state itself when small, else the pass's start to rerun from."""

    def __init__(self, input_iterator: DatasetIterator[Any], dataset: ScanDataset) -> None:
        super().__init__(input_iterator)
        self._signature = dataset._signature
        self._scan_func = dataset._scan_func
        self._carry = self._signature.initial
        self._start = input_iterator.get_state()
        self._num_scanned = 0
        self._ahead: list[Any] = []
        self._position = 0
        self._anchor: State | None = None

    def _step(self, element: Any) -> Any:
        new_state, output = _split_result(self._scan_func(self._carry, element), "scan_func")
        self._carry = self._signature.check(new_state)
        self._num_scanned += 1
        if isinstance(output, bytes) or (isinstance(output, np.ndarray | np.generic) and output.dtype.kind not in "US"):
            return output
        return structure.normalize(output)

    def __next__(self) -> Any:
        if self._position < len(self._ahead):
            self._position += 1
            return self._step(self._ahead[self._position - 1])
        return self._step(next(self._input))

    def next_many(self, max_count: int) -> list[Any]:
        if self._position == len(self._ahead):
            if not (has_bulk_next(self._input) and self._input.deterministic):
                return [next(self)]
            anchor = self._input.get_state()
            self._ahead, self._position = self._input.next_many(max_count), 0
            self._anchor = anchor
        out: list[Any] = []
        end = min(len(self._ahead), self._position + max_count)
        while self._position < end:
            try:
                out.append(self._step(self._ahead[self._position]))
            except Exception:
                if not out:
                    self._position += 1  # a failed step uses up its element, as in next()
                    raise
                break  # the next call steps this element again, and raises
            self._position += 1
        return out

    def get_state(self) -> State:
        behind = self._position < len(self._ahead)
        state: State = {
            "input": self._anchor if behind else self._input.get_state(),
            "skip": self._position if behind else 0,
            "num_scanned": self._num_scanned,
            "carry": self._signature.encode(self._carry),
        }
        if state["carry"] is None:
            state["start"] = self._start
        return state

    def set_state(self, state: State) -> None:
        self._ahead, self._position, self._anchor = [], 0, None
        self._num_scanned = int(state["num_scanned"])
        if state["carry"] is not None:
            self._carry = self._signature.decode(state["carry"])
        else:
            # Rebuild the carried state by scanning again from the start; the input then stands where it was saved.
            self._input.set_state(state["start"])
            self._carry = self._signature.initial
            for _ in range(self._num_scanned):
                new_state, _ = _split_result(self._scan_func(self._carry, next(self._input)), "scan_func")
                self._carry = self._signature.check(new_state)
            return
        self._input.set_state(state["input"])
        replay(self._input, int(state["skip"]))
