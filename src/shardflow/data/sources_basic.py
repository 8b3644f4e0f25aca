"""In-memory sources: range, from_tensors, from_tensor_slices, from_generator, list_files and zip."""

from __future__ import annotations

import errno
import glob
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from shardflow.data import structure
from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.dataset import Dataset, DatasetIterator, State
from shardflow.data.element_spec import STRING, TensorSpec, normalized, spec_dtype, spec_or_none
from shardflow.data.errors import InvalidArgumentError, NotFoundError


class RangeDataset(Dataset[np.generic]):
    def __init__(self, *args: int, output_type: Any = np.int64) -> None:
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range takes (stop), (start, stop) or (start, stop, step), got {len(args)} arguments")
        if len(args) == 3 and args[2] == 0:
            raise InvalidArgumentError("range step must not be 0")
        self._range = range(*(int(arg) for arg in args))
        self._output_type = np.dtype(output_type).type
        if not issubclass(self._output_type, np.integer | np.floating):
            raise TypeError(f"range output_type must be an integer or float dtype, got {output_type!r}")

    def _iterator(self) -> DatasetIterator[np.generic]:
        return _IndexIterator(len(self._range), self._element_at, self._elements_between)

    def _cardinality(self) -> int:
        return len(self._range)

    def _element_spec(self) -> TensorSpec:
        return TensorSpec(shape=(), dtype=np.dtype(self._output_type))

    def _element_at(self, index: int) -> np.generic:
        value: np.generic = self._output_type(self._range[index])
        return value

    def _elements_between(self, start: int, end: int) -> list[np.generic]:
        # One arange for the whole slice: several times faster than converting each int.
        part = self._range[start:end]
        return list(np.arange(part.start, part.stop, part.step, dtype=np.int64).astype(self._output_type, copy=False))


class ElementsDataset(Dataset[Any]):
    """A dataset over a list of already-normalized elements."""

    def __init__(self, elements: Sequence[Any]) -> None:
        self._elements = elements

    def _iterator(self) -> DatasetIterator[Any]:
        return _IndexIterator(len(self._elements), self._elements.__getitem__)

    def _cardinality(self) -> int:
        return len(self._elements)


class _IndexIterator(DatasetIterator[Any]):
    def __init__(
        self,
        length: int,
        element_at: Callable[[int], Any],
        elements_between: Callable[[int, int], list[Any]] | None = None,
    ) -> None:
        self._length = length
        self._element_at = element_at
        self._elements_between = elements_between or (lambda start, end: list(map(element_at, range(start, end))))
        self._index = 0

    def __next__(self) -> Any:
        if self._index >= self._length:
            raise StopIteration
        self._index += 1
        return self._element_at(self._index - 1)

    def next_many(self, max_count: int) -> list[Any]:
        start = self._index
        if start >= self._length:
            raise StopIteration
        self._index = min(start + max_count, self._length)
        return self._elements_between(start, self._index)

    def get_state(self) -> State:
        return {"index": self._index}

    def set_state(self, state: State) -> None:
        self._index = int(state["index"])


class TensorsDataset(ElementsDataset):
    def __init__(self, element: Any) -> None:
        super().__init__([structure.normalize(element)])

    def _element_spec(self) -> Any | None:
        return spec_or_none(self._elements[0])


class TensorSlicesDataset(Dataset[Any]):
    """Slices every leaf along its first dimension; all leaves must have the same first dimension."""

    def __init__(self, element: Any) -> None:
        leaves, self._treedef = structure.flatten(structure.normalize(element))
        if not leaves:
            raise ValueError("from_tensor_slices needs at least one array")
        for leaf in leaves:
            if not isinstance(leaf, np.ndarray) or leaf.ndim == 0:
                raise ValueError(f"from_tensor_slices needs arrays of rank >= 1 to slice, got a scalar {leaf!r:.40}")
        lengths = {len(leaf) for leaf in leaves}
        if len(lengths) > 1:
            shapes = ", ".join(str(leaf.shape) for leaf in leaves)
            raise ValueError(f"from_tensor_slices needs equal first dimensions, got shapes {shapes}")
        self._leaves = leaves
        self._length = lengths.pop()

    def _element_at(self, index: int) -> Any:
        return structure.pack(self._treedef, [leaf[index] for leaf in self._leaves])

    def _elements_between(self, start: int, end: int) -> list[Any]:
        # Iterating an array yields what indexing it would (rows, or numpy scalars), without a call per element.
        if self._treedef is None:
            return list(self._leaves[0][start:end])
        rows = zip(*(leaf[start:end] for leaf in self._leaves), strict=True)
        return [structure.pack(self._treedef, row) for row in rows]

    def _iterator(self) -> DatasetIterator[Any]:
        return _IndexIterator(self._length, self._element_at, self._elements_between)

    def _cardinality(self) -> int:
        return self._length

    def _element_spec(self) -> Any:
        leaves = [TensorSpec(shape=tuple(leaf.shape[1:]), dtype=spec_dtype(leaf.dtype)) for leaf in self._leaves]
        return structure.pack(self._treedef, leaves)


class GeneratorDataset(Dataset[Any]):
    """Elements of a Python generator. Its state is the number of elements consumed, so `set_state` calls
    `generator(*args)` again and skips that many: the generator must yield the same sequence every time."""

    def __init__(
        self,
        generator: Callable[..., Any],
        output_signature: Any = None,
        args: tuple[Any, ...] | None = None,
        output_types: Any = None,
        output_shapes: Any = None,
    ) -> None:
        if not callable(generator):
            raise TypeError(f"from_generator needs a callable that returns an iterator, got {type(generator).__name__}")
        self._generator = generator
        self._args = tuple(args or ())
        if output_types is not None:
            if output_signature is not None:
                raise TypeError("from_generator takes output_signature or output_types (and output_shapes), not both")
            output_signature = _signature_from_types(output_types, output_shapes)
        elif output_shapes is not None:
            raise TypeError("from_generator output_shapes needs output_types")
        self._signature = None if output_signature is None else structure.flatten(output_signature)

    def _iterator(self) -> DatasetIterator[Any]:
        return _GeneratorIterator(self)

    def _element_spec(self) -> Any | None:
        if self._signature is None:
            return None
        specs, treedef = self._signature
        return structure.pack(treedef, [normalized(spec) for spec in specs])

    def _start(self) -> Iterator[Any]:
        return iter(self._generator(*self._args))

    def _convert(self, element: Any) -> Any:
        element = structure.normalize(element)
        if self._signature is None:
            return element
        specs, treedef = self._signature
        leaves, actual = structure.flatten(element)
        if actual != treedef:
            try:
                leaves = structure.flatten_as(treedef, element, "from_generator")
            except TypeError:
                raise TypeError(
                    f"from_generator: the generator yielded structure {structure.describe(actual)}, "
                    f"but output_signature is {structure.describe(treedef)}"
                ) from None
        return structure.pack(treedef, [_conform(leaf, spec) for leaf, spec in zip(leaves, specs, strict=True)])


def _signature_from_types(output_types: Any, output_shapes: Any) -> Any:
    """tf.data's older form of output_signature: a structure of dtypes and one of shapes (None: any shape)."""
    dtypes, treedef = structure.flatten(output_types)
    if output_shapes is None:
        shapes: list[Any] = [None] * len(dtypes)
    else:
        shapes = structure.flatten_up_to(treedef, output_shapes, "from_generator output_shapes")
    specs = [TensorSpec(shape=shape, dtype=dtype) for dtype, shape in zip(dtypes, shapes, strict=True)]
    return structure.pack(treedef, specs)


def _conform(leaf: Any, spec: TensorSpec) -> Any:
    if spec.dtype in (bytes, str, object):
        converted = leaf
    else:
        converted = np.asarray(leaf, dtype=spec.dtype)
        converted = converted[()] if converted.ndim == 0 else converted
    shape = np.shape(converted) if not isinstance(converted, bytes) else ()
    if spec.shape is not None and (
        len(shape) != len(spec.shape)
        or any(want not in (None, got) for want, got in zip(spec.shape, shape, strict=True))
    ):
        raise ValueError(f"from_generator: the generator yielded shape {shape}, output_signature expects {spec.shape}")
    return converted


class _GeneratorIterator(DatasetIterator[Any]):
    def __init__(self, dataset: GeneratorDataset) -> None:
        self._dataset = dataset
        self._source: Iterator[Any] | None = None
        self._consumed = 0

    def __next__(self) -> Any:
        if self._source is None:
            self._source = self._dataset._start()
            for _ in range(self._consumed):
                next(self._source)
        element = next(self._source)
        self._consumed += 1
        return self._dataset._convert(element)

    def get_state(self) -> State:
        return {"consumed": self._consumed}

    def set_state(self, state: State) -> None:
        self._source = None
        self._consumed = int(state["consumed"])


class ListFilesDataset(Dataset[bytes]):
    """The files matching one or more glob patterns, as bytes paths, sorted (and shuffled by default)."""

    def __init__(self, file_pattern: str | Sequence[str], shuffle: bool | None = None, seed: int | None = None) -> None:
        patterns = [file_pattern] if isinstance(file_pattern, str | bytes | os.PathLike) else list(file_pattern)
        # One sorted list across all patterns, a file matched twice listed twice, as tf.data's list_files.
        files = sorted(path for pattern in patterns for path in glob.glob(os.fsdecode(pattern)))
        if not files:
            # tf.data raises InvalidArgumentError here; a NotFoundError is still a FileNotFoundError, as before.
            pattern = ", ".join(map(os.fsdecode, patterns))
            raise NotFoundError(errno.ENOENT, f"list_files: no files matched pattern {pattern}", pattern)
        self._build([os.fsencode(path) for path in files], True if shuffle is None else shuffle, seed)

    def _build(self, files: list[bytes], shuffle: bool, seed: int | None) -> None:
        self._files, self._shuffle, self._seed = files, shuffle, seed
        # Built once, so that each new pass reshuffles, as tf.data's list_files does.
        self._pipeline: Dataset[Any] = ElementsDataset(files)
        if shuffle:
            self._pipeline = self._pipeline.shuffle(len(files), seed=seed)

    def _iterator(self) -> DatasetIterator[bytes]:
        return iter(self._pipeline)

    def _cardinality(self) -> int:
        return len(self._files)

    def _element_spec(self) -> TensorSpec:
        return STRING

    def _shard_files(self, num_shards: int, index: int) -> Dataset[bytes]:
        if len(self._files) < num_shards:
            raise ValueError(
                f"FILE auto-sharding needs at least one file per worker: {len(self._files)} files for {num_shards} "
                "workers; use more files or AutoShardPolicy.DATA"
            )
        # The sorted list is sharded before any shuffle, so workers get disjoint files whatever their seeds.
        shard = ListFilesDataset.__new__(ListFilesDataset)
        shard._build(self._files[index::num_shards], self._shuffle, self._seed)
        return shard


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
