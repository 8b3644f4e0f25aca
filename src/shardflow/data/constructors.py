"""tf.data's static constructors of a Dataset (range, from_tensors, zip, ...), a base class of Dataset."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from shardflow.data.dataset import Dataset


class DatasetConstructors:
    """`Dataset.range(...)`, `Dataset.from_tensor_slices(...)` and the other sources that tf.data builds with a
    static method of Dataset. Each imports its source's module when called: the sources subclass Dataset, which
    subclasses this class, so importing them above would be a cycle."""

    @staticmethod
    def range(*args: int, output_type: Any = np.int64, name: str | None = None) -> Dataset[Any]:
        """range(stop), range(start, stop) or range(start, stop, step) of `output_type` (int64) scalars."""
        from shardflow.data.sources.in_memory import RangeDataset

        return RangeDataset(*args, output_type=output_type)

    @staticmethod
    def from_tensors(element: Any, name: str | None = None) -> Dataset[Any]:
        from shardflow.data.sources.in_memory import TensorsDataset

        return TensorsDataset(element)

    @staticmethod
    def from_tensor_slices(element: Any, name: str | None = None) -> Dataset[Any]:
        from shardflow.data.sources.in_memory import TensorSlicesDataset

        return TensorSlicesDataset(element)

    @staticmethod
    def from_generator(
        generator: Callable[..., Any],
        output_types: Any = None,
        output_shapes: Any = None,
        args: tuple[Any, ...] | None = None,
        output_signature: Any = None,
        name: str | None = None,
    ) -> Dataset[Any]:
        """`output_signature` (a structure of TensorSpecs), or its older form `output_types` with `output_shapes`,
        converts and checks each element; without either, elements are taken as they come."""
        from shardflow.data.sources.generator import GeneratorDataset

        return GeneratorDataset(generator, output_signature, args, output_types, output_shapes)

    @staticmethod
    def list_files(
        file_pattern: str | list[str], shuffle: bool | None = None, seed: int | None = None, name: str | None = None
    ) -> Dataset[Any]:
        from shardflow.data.sources.list_files import ListFilesDataset

        return ListFilesDataset(file_pattern, shuffle=shuffle, seed=seed)

    @staticmethod
    def zip(*datasets: Any, name: str | None = None) -> Dataset[Any]:
        """zip(a, b) or zip((a, b)) or zip({"x": a, "y": b}): elements shaped like the argument."""
        from shardflow.data.zip import ZipDataset

        return ZipDataset(datasets[0] if len(datasets) == 1 else datasets)

    @staticmethod
    def sample_from_datasets(
        datasets: list[Dataset[Any]],
        weights: Any = None,
        seed: int | None = None,
        stop_on_empty_dataset: bool = False,
        rerandomize_each_iteration: bool | None = None,
    ) -> Dataset[Any]:
        """Each element from one of `datasets`, drawn with `weights` (a list, or a dataset of weight vectors)."""
        from shardflow.data.sampling import DirectedDataset, check_datasets

        return DirectedDataset(
            check_datasets(datasets, "sample_from_datasets"),
            stop_on_empty_dataset,
            weights=weights,
            seed=seed,
            rerandomize_each_iteration=rerandomize_each_iteration,
        )

    @staticmethod
    def choose_from_datasets(
        datasets: list[Dataset[Any]], choice_dataset: Dataset[Any], stop_on_empty_dataset: bool = True
    ) -> Dataset[Any]:
        """Each element from the dataset that the next int64 of `choice_dataset` names."""
        from shardflow.data.dataset import Dataset
        from shardflow.data.sampling import DirectedDataset, check_datasets

        if not isinstance(choice_dataset, Dataset):
            raise TypeError(
                f"choose_from_datasets choice_dataset must be a Dataset, got {type(choice_dataset).__name__}"
            )
        return DirectedDataset(
            check_datasets(datasets, "choose_from_datasets"), stop_on_empty_dataset, choice_dataset=choice_dataset
        )

    @staticmethod
    def counter(start: int = 0, step: int = 1, dtype: Any = "int64", name: str | None = None) -> Dataset[Any]:
        """start, start + step, ... without end."""
        from shardflow.data.counter import CounterDataset

        return CounterDataset(start, step, dtype)

    @staticmethod
    def random(
        seed: int | None = None, rerandomize_each_iteration: bool | None = None, name: str | None = None
    ) -> Dataset[Any]:
        """Endless int64 scalars uniform in [0, 2**32), as tf.data's; the stream itself differs from TensorFlow's."""
        from shardflow.data.counter import RandomDataset

        return RandomDataset(seed, rerandomize_each_iteration)

    @staticmethod
    def load(
        path: str, element_spec: Any = None, compression: str | None = None, reader_func: Any = None
    ) -> Dataset[Any]:
        """A dataset written by `save` (shardflow's own format, see saved_format.py). The records carry their
        structure and dtypes, so `element_spec` is accepted for tf.data compatibility and not needed."""
        from shardflow.data.snapshot import LoadDataset

        return LoadDataset(path, compression, reader_func)
