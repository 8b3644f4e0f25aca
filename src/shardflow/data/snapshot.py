"""save, load and snapshot: a dataset written to disk in shardflow's own format (saved_format.py) and read back."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable
from typing import Any

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, IterationScope, State, UnaryDataset, has_bulk_next
from shardflow.data.errors import NotFoundError
from shardflow.data.saved_format import (
    MANIFEST,
    ShardReader,
    ShardWriter,
    read_manifest,
    remove_replaced,
    resolve_compression,
    write_manifest,
)
from shardflow.data.sources.in_memory import ElementsDataset

_BULK_ELEMENTS = 1024


class _RunWriter:
    """The shard files one pass writes into `directory`; `commit` makes them the saved dataset there."""

    def __init__(self, directory: str, compression: str | None, shard_func: Callable[..., Any] | None) -> None:
        os.makedirs(directory, exist_ok=True)
        self._directory = directory
        self._compression = compression
        self._shard_func = shard_func
        self._run = secrets.token_hex(4)
        self._writers: dict[int, ShardWriter] = {}

    def append(self, element: Any) -> None:
        index = 0
        if self._shard_func is not None:
            value = structure.call_with_element(self._shard_func, element)
            if not isinstance(value, int) and not (hasattr(value, "dtype") and value.dtype.kind in "iu"):
                raise TypeError(f"shard_func must return an integer scalar, got {type(value).__name__}")
            index = int(value)
            if index < 0:
                raise ValueError(f"shard_func must return a non-negative shard index, got {index}")
        writer = self._writers.get(index)
        if writer is None:
            name = f"{self._run}-shard-{index:05d}.sfdata"
            writer = self._writers[index] = ShardWriter(os.path.join(self._directory, name), self._compression)
        writer.append(element)

    def commit(self) -> None:
        shards = []
        for index in sorted(self._writers):
            writer = self._writers[index]
            writer.finish()
            shards.append((os.path.basename(writer.path), writer.num_elements))
        self._writers = {}
        replaced = read_manifest(self._directory)
        committed = write_manifest(self._directory, self._compression, shards)
        remove_replaced(self._directory, replaced, committed)

    def abandon(self) -> None:
        for writer in self._writers.values():
            writer.abandon()
        self._writers = {}


def save(
    dataset: Dataset[Any],
    path: str,
    compression: str | None,
    shard_func: Callable[..., Any] | None,
    checkpoint_args: Any,
) -> None:
    """Writes every element of one pass under the directory `path`, replacing what was saved there only once the
    pass is complete. Elements go to shard `shard_func(element)` (0 without one); `load` reads the shards back."""
    if checkpoint_args is not None:
        raise ValueError(
            "save checkpoint_args is not supported: a shardflow save is committed only when complete, so after an "
            "interruption run save again"
        )
    writer = _RunWriter(os.fspath(path), resolve_compression(compression, "save"), shard_func)
    iterator = iter(dataset)
    bulk = has_bulk_next(iterator)
    try:
        while True:
            try:
                elements = iterator.next_many(_BULK_ELEMENTS) if bulk else [next(iterator)]
            except StopIteration:
                break
            for element in elements:
                writer.append(element)
    except BaseException:
        writer.abandon()
        raise
    finally:
        iterator.close()
    writer.commit()


class _ShardDataset(Dataset[Any]):
    def __init__(self, path: str, compression: str | None) -> None:
        self._path = path
        self._compression = compression

    def _iterator(self) -> DatasetIterator[Any]:
        return _ShardIterator(self._path, self._compression)


class _ShardIterator(DatasetIterator[Any]):
    """State: the index of the next record. The file is opened on the first read."""

    def __init__(self, path: str, compression: str | None) -> None:
        self._path = path
        self._compression = compression
        self._reader: ShardReader | None = None
        self._index = 0

    def _open(self) -> ShardReader:
        if self._reader is None:
            self._reader = ShardReader(self._path, self._compression)
            self._reader.seek(self._index)
        return self._reader

    def __next__(self) -> Any:
        return self.next_many(1)[0]

    def next_many(self, max_count: int) -> list[Any]:
        reader = self._open()
        out: list[Any] = []
        try:
            while len(out) < max_count:
                out.append(reader.read())
        except StopIteration:
            if not out:
                raise
        except Exception:
            # A damaged record closed the file. Raised now, it is passed (so ignore_errors can skip it); otherwise
            # the next call reopens the file at it and raises.
            self._reader = None
            if not out:
                self._index += 1
                raise
        self._index += len(out)
        return out

    def get_state(self) -> State:
        return {"index": self._index}

    def set_state(self, state: State) -> None:
        self._index = int(state["index"])
        if self._reader is not None:
            self._reader.seek(self._index)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _reader_pipeline(directory: str, manifest: dict[str, Any], reader_func: Callable[..., Any] | None) -> Dataset[Any]:
    """The saved elements: `reader_func` gets a dataset of the shards' datasets, as in tf.data; by default the shards
    are interleaved one element at a time, so a dataset saved as one shard reads back in its original order."""
    shards = ElementsDataset(
        [_ShardDataset(os.path.join(directory, shard["file"]), manifest["compression"]) for shard in manifest["shards"]]
    )
    if reader_func is None:
        return shards.interleave(lambda shard: shard, cycle_length=max(1, len(manifest["shards"])))
    pipeline = reader_func(shards)
    if not isinstance(pipeline, Dataset):
        raise TypeError(f"reader_func must return a Dataset, got {type(pipeline).__name__}")
    return pipeline


class LoadDataset(Dataset[Any]):
    def __init__(self, path: str, compression: str | None, reader_func: Callable[..., Any] | None) -> None:
        directory = os.fspath(path)
        manifest = read_manifest(directory)
        if manifest is None:
            raise NotFoundError(
                errno.ENOENT,
                f"load: no saved dataset here (no {MANIFEST}; save writes it last, so a save that did not complete "
                "leaves none)",
                directory,
            )
        if compression is not None and resolve_compression(compression, "load") != manifest["compression"]:
            raise ValueError(
                f"load: {directory} was saved with compression {manifest['compression']!r}, not {compression!r}"
            )
        self._pipeline = _reader_pipeline(directory, manifest, reader_func)

    def _iterator(self) -> DatasetIterator[Any]:
        return iter(self._pipeline)


class SnapshotDataset(UnaryDataset[Any]):
    """The first pass that runs to the end is saved under `path`/<fingerprint of the input pipeline>; every later
    pass, in this process or another running the same pipeline, reads the saved elements instead."""

    def __init__(
        self,
        input_dataset: Dataset[Any],
        path: str,
        compression: str | None,
        reader_func: Callable[..., Any] | None,
        shard_func: Callable[..., Any] | None,
    ) -> None:
        super().__init__(input_dataset)
        self._path = os.fspath(path)
        self._compression = resolve_compression(compression, "snapshot")
        self._reader_func = reader_func
        self._shard_func = shard_func
        self._directory: str | None = None

    def _with_inputs(self, inputs: tuple[Dataset[Any], ...]) -> Dataset[Any]:
        clone = super()._with_inputs(inputs)
        assert isinstance(clone, SnapshotDataset)
        clone._directory = None  # another input pipeline has another fingerprint
        return clone

    def directory(self) -> str:
        if self._directory is None:
            # Here, not at the top: fingerprint walks datasets of every kind, this one included.
            from shardflow.data.fingerprint import fingerprint

            self._directory = os.path.join(self._path, f"{int(fingerprint(self._input)):016x}")
        return self._directory

    def _saved(self) -> Dataset[Any] | None:
        """The saved elements, if a complete snapshot of this pipeline exists."""
        manifest = read_manifest(self.directory())
        return None if manifest is None else _reader_pipeline(self.directory(), manifest, self._reader_func)

    def _iterator(self) -> DatasetIterator[Any]:
        return _SnapshotIterator(self)

    def _cardinality(self) -> int:
        return self._input._cardinality()


class _SnapshotIterator(DatasetIterator[Any]):
    """Reads the snapshot when one is complete, else passes the input through while writing it. State: the mode and
    the reader's or the input's state; a pass restored in the middle of writing passes elements through unwritten
    (the next complete pass writes the snapshot)."""

    def __init__(self, dataset: SnapshotDataset) -> None:
        self._dataset = dataset
        self._scope = IterationScope()
        saved = dataset._saved()
        self._reader = None if saved is None else iter(saved)
        self._input: DatasetIterator[Any] | None = None
        self._writer: _RunWriter | None = None
        if self._reader is None:
            self._input = iter(dataset._input)
            self._writer = _RunWriter(dataset.directory(), dataset._compression, dataset._shard_func)

    def __next__(self) -> Any:
        if self._reader is not None:
            return next(self._reader)
        assert self._input is not None
        try:
            element = next(self._input)
        except StopIteration:
            if self._writer is not None:
                self._writer.commit()
                self._writer = None
            raise
        if self._writer is not None:
            self._writer.append(element)
        return element

    @property
    def deterministic(self) -> bool:
        active = self._reader if self._reader is not None else self._input
        return active is None or active.deterministic

    def get_state(self) -> State:
        if self._reader is not None:
            return {"mode": "read", "reader": self._reader.get_state()}
        assert self._input is not None
        return {"mode": "write", "input": self._input.get_state()}

    def set_state(self, state: State) -> None:
        self.close()
        if state["mode"] == "read":
            saved = self._dataset._saved()
            if saved is None:
                raise NotFoundError(
                    errno.ENOENT,
                    "snapshot: the state was saved while reading a complete snapshot, which is now gone",
                    self._dataset.directory(),
                )
            self._reader = self._scope.iter(saved)
            self._reader.set_state(state["reader"])
            return
        self._input = self._scope.iter(self._dataset._input)
        self._input.set_state(state["input"])

    def close(self) -> None:
        for iterator in (self._reader, self._input):
            if iterator is not None:
                iterator.close()
        self._reader = self._input = None
        if self._writer is not None:
            self._writer.abandon()
            self._writer = None
