"""The machinery every file source shares: a reader per file that returns records in batches, and an
iterator that walks the files in order and saves its position as (file index, position in the file)."""

from __future__ import annotations

import abc
import copy
from typing import Any, Generic, TypeVar

import numpy as np

from shardflow.data.dataset import Dataset, DatasetIterator, State
from shardflow.data.sources.errors import InvalidRecordError
from shardflow.data.sources.files import filename_list

T = TypeVar("T")


class RecordReader(abc.ABC, Generic[T]):
    """Reads one file. Each `read_batch()` returns the records of the next chunk; [] at the end of the file."""

    @abc.abstractmethod
    def read_batch(self) -> list[T]: ...

    @abc.abstractmethod
    def position(self, count: int) -> dict[str, Any]:
        """Where the file stands after `count` records of the last batch (a JSON-serializable dict). After
        read_batch() raised an InvalidRecordError, where it stands after the bad record."""

    @abc.abstractmethod
    def close(self) -> None: ...


class FileDataset(Dataset[T]):
    """A source over a list of files. It reads them one after the other; with num_parallel_reads > 1 (or
    AUTOTUNE) it reads that many at once, as tf.data does: an interleave of one-file sources, block_length 1."""

    def __init__(self, filenames: object, num_parallel_reads: int | None = None) -> None:
        self.filenames = filename_list(filenames)
        self.num_parallel_reads = num_parallel_reads

    @abc.abstractmethod
    def open_reader(self, filename: str, position: dict[str, Any] | None) -> RecordReader[T]:
        """A reader of `filename` starting at `position` (one that `RecordReader.position` returned), or at the
        file's first record."""

    def _iterator(self) -> DatasetIterator[T]:
        if self.num_parallel_reads is None or self.num_parallel_reads == 1:
            return FilesIterator(self)
        files: Dataset[Any] = Dataset.from_tensor_slices(np.array(self.filenames, dtype=object))
        interleaved: Dataset[T] = files.interleave(
            self._with_files,
            cycle_length=self.num_parallel_reads,
            block_length=1,
            num_parallel_calls=self.num_parallel_reads,
        )
        return iter(interleaved)

    def _with_files(self, filenames: object) -> FileDataset[T]:
        """This source over other files, reading them one after the other."""
        dataset = copy.copy(self)
        dataset.filenames = filename_list(filenames)
        dataset.num_parallel_reads = None
        return dataset

    def _shard_files(self, num_shards: int, index: int) -> Dataset[T]:
        if len(self.filenames) < num_shards:
            raise ValueError(
                f"FILE auto-sharding needs at least one file per worker: {len(self.filenames)} files for "
                f"{num_shards} workers; use more files or AutoShardPolicy.DATA"
            )
        dataset = copy.copy(self)
        dataset.filenames = self.filenames[index::num_shards]
        return dataset


class FilesIterator(DatasetIterator[T]):
    """Yields the records of every file in order. State: {"file_index": i, **position in file i}.

    A file that cannot be opened, a DataLossError, or any other error of its reader ends that file: the error is
    raised and the next call reads the next file. Only an InvalidRecordError (a CSV line that cannot be decoded)
    leaves the reader where it is, past the bad record.
    """

    def __init__(self, dataset: FileDataset[T]) -> None:
        self._dataset = dataset
        self._file_index = 0
        self._reader: RecordReader[T] | None = None
        self._batch: list[T] = []
        self._count = 0  # records of _batch already returned

    def __next__(self) -> T:
        count = self._count
        if count < len(self._batch):
            self._count = count + 1
            return self._batch[count]
        return self._next_batch()

    def next_many(self, max_count: int) -> list[T]:
        count = self._count
        if count == len(self._batch):
            self._next_batch()
            count = 0
        end = min(count + max_count, len(self._batch))
        self._count = end
        return self._batch[count:end]

    def _next_batch(self) -> T:
        filenames = self._dataset.filenames
        while True:
            if self._reader is None:
                if self._file_index >= len(filenames):
                    raise StopIteration
                try:
                    self._reader = self._dataset.open_reader(filenames[self._file_index], None)
                except Exception:
                    # A file that cannot be opened (missing, not of this format) is one error: a caller who skips
                    # errors goes on with the next file instead of opening this one again forever.
                    self._file_index += 1
                    raise
            self._batch, self._count = [], 0
            try:
                batch = self._reader.read_batch()
            except InvalidRecordError:
                raise  # the reader stands past the bad record; the next call reads the one after it
            except Exception:
                # Past a corrupt or truncated record there is no way to find the next one; and a reader that failed
                # otherwise might fail at the same place forever.
                self._next_file()
                raise
            if batch:
                self._batch, self._count = batch, 1
                return batch[0]
            self._next_file()

    def _next_file(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._file_index += 1

    def get_state(self) -> State:
        if self._reader is None:
            return {"file_index": self._file_index}
        return {"file_index": self._file_index, **self._reader.position(self._count)}

    def set_state(self, state: State) -> None:
        file_index = int(state["file_index"])
        if not 0 <= file_index <= len(self._dataset.filenames):
            raise ValueError(
                f"state names file {file_index}, but this dataset has {len(self._dataset.filenames)} files"
            )
        self.close()
        self._file_index = file_index
        position = {key: value for key, value in state.items() if key != "file_index"}
        if position and file_index < len(self._dataset.filenames):
            self._reader = self._dataset.open_reader(self._dataset.filenames[file_index], position)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._batch, self._count = [], 0
