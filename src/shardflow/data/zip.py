"""zip: elements of several datasets side by side, in the structure (tuple or dict) the datasets were given in."""

from __future__ import annotations

from typing import Any

from shardflow.data import structure
from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.dataset import Dataset, DatasetIterator, State


class ZipDataset(Dataset[Any]):
    def __init__(self, datasets: Any) -> None:
        self._datasets, self._treedef = structure.flatten(datasets)
        for dataset in self._datasets:
            if not isinstance(dataset, Dataset):
                raise TypeError(f"zip takes datasets (or a tuple or dict of them), got {type(dataset).__name__}")

    def _inputs(self) -> tuple[Dataset[Any], ...]:
        return tuple(self._datasets)

    def _with_inputs(self, inputs: tuple[Dataset[Any], ...]) -> Dataset[Any]:
        return ZipDataset(structure.pack(self._treedef, inputs))

    def _iterator(self) -> DatasetIterator[Any]:
        return _ZipIterator([iter(dataset) for dataset in self._datasets], self._treedef)

    def _cardinality(self) -> int:
        counts = [dataset._cardinality() for dataset in self._datasets]
        if UNKNOWN_CARDINALITY in counts:
            return UNKNOWN_CARDINALITY
        finite = [count for count in counts if count != INFINITE_CARDINALITY]
        return min(finite) if finite else INFINITE_CARDINALITY

    def _element_spec(self) -> Any | None:
        specs = [dataset._element_spec() for dataset in self._datasets]
        return None if any(spec is None for spec in specs) else structure.pack(self._treedef, specs)


class _ZipIterator(DatasetIterator[Any]):
    def __init__(self, iterators: list[DatasetIterator[Any]], treedef: structure.TreeDef) -> None:
        self._iterators = iterators
        self._treedef = treedef

    def __next__(self) -> Any:
        return structure.pack(self._treedef, [next(iterator) for iterator in self._iterators])

    @property
    def deterministic(self) -> bool:
        return all(iterator.deterministic for iterator in self._iterators)

    def get_state(self) -> State:
        return {"inputs": [iterator.get_state() for iterator in self._iterators]}

    def set_state(self, state: State) -> None:
        for iterator, input_state in zip(self._iterators, state["inputs"], strict=True):
            iterator.set_state(input_state)

    def close(self) -> None:
        for iterator in self._iterators:
            iterator.close()
