"""from_generator: the elements of a Python generator, converted to and checked against a signature if given."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State
from shardflow.data.element_spec import TensorSpec, normalized


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
