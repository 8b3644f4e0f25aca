"""list_files: the names of the files that match glob patterns, sorted and by default shuffled, as tf.data's."""

from __future__ import annotations

import errno
import glob
import os
from collections.abc import Sequence
from typing import Any

from shardflow.data.dataset import Dataset, DatasetIterator
from shardflow.data.element_spec import STRING, TensorSpec
from shardflow.data.errors import NotFoundError
from shardflow.data.sources.in_memory import ElementsDataset


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
