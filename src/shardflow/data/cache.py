"""cache(filename): the first complete pass is kept in memory or in a file, and later passes read it back."""

from __future__ import annotations

import io
import os
import struct
import threading
from typing import Any, NoReturn

import msgpack
import numpy as np

from shardflow.data import codec
from shardflow.data.dataset import Dataset, DatasetIterator, IterationScope, State, UnaryDataset

_MAGIC = b"SFCACHE1"
_RECORD_HEAD = struct.Struct("<IQ")
_FOOTER = struct.Struct("<QQ8s")


class CacheDataset(UnaryDataset[Any]):
    def __init__(self, input_dataset: Dataset[Any], filename: str) -> None:
        super().__init__(input_dataset)
        if not isinstance(filename, str | os.PathLike):
            raise TypeError(f"cache filename must be a path or '' for memory, got {type(filename).__name__}")
        self._filename = filename
        self._path = os.fspath(filename) + ".shardflow-cache" if os.fspath(filename) else ""
        self._lock = threading.Lock()
        self._memory: list[Any] | None = None

    def _with_inputs(self, inputs: tuple[Dataset[Any], ...]) -> Dataset[Any]:
        # A rewritten input (a worker's shard) must not see what the original cached.
        (input_dataset,) = inputs
        return CacheDataset(input_dataset, self._filename)

    def _iterator(self) -> DatasetIterator[Any]:
        return _CacheIterator(self)

    def _cardinality(self) -> int:
        return self._input._cardinality()

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()

    def _open_reader(self) -> _MemoryReader | _FileReader | None:
        if not self._path:
            with self._lock:
                return None if self._memory is None else _MemoryReader(self._memory)
        return _FileReader(self._path) if os.path.exists(self._path) else None

    def _open_writer(self) -> _MemoryWriter | _FileWriter:
        return _FileWriter(self._path) if self._path else _MemoryWriter(self)

    def _publish(self, elements: list[Any]) -> None:
        with self._lock:
            if self._memory is None:
                self._memory = elements


class _MemoryReader:
    def __init__(self, elements: list[Any]) -> None:
        self._elements = elements
        self.count = len(elements)

    def get(self, index: int) -> Any:
        return self._elements[index]

    def close(self) -> None:
        pass


class _MemoryWriter:
    def __init__(self, dataset: CacheDataset) -> None:
        self._dataset = dataset
        self._elements: list[Any] = []

    def append(self, element: Any) -> None:
        self._elements.append(element)

    def finish(self) -> None:
        self._dataset._publish(self._elements)

    def abandon(self) -> None:
        self._elements = []


class _FileWriter:
    """The file format is shardflow's own framing (codec.py), never pickle: a magic, then records of
    [u32 header length][u64 payload length][msgpack header][payload], then the records' offsets as int64 and a footer
    [u64 count][u64 offsets position][magic]. It is written to a temporary name and renamed when the pass completes,
    so a file that exists is whole.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._temporary = f"{path}.tmp-{os.getpid()}-{id(self)}"
        self._file: io.BufferedWriter = open(self._temporary, "wb")  # noqa: SIM115 - closed in finish() or abandon()
        self._file.write(_MAGIC)
        self._offsets: list[int] = []

    def append(self, element: Any) -> None:
        encoded = codec.encode(element)
        header = msgpack.packb(encoded.spec)
        payload = bytearray(encoded.nbytes)
        codec.write(encoded, memoryview(payload), 0)
        self._offsets.append(self._file.tell())
        self._file.write(_RECORD_HEAD.pack(len(header), len(payload)) + header)
        self._file.write(payload)

    def finish(self) -> None:
        offsets_position = self._file.tell()
        self._file.write(np.asarray(self._offsets, dtype="<i8").tobytes())
        self._file.write(_FOOTER.pack(len(self._offsets), offsets_position, _MAGIC))
        self._file.close()
        os.replace(self._temporary, self._path)

    def abandon(self) -> None:
        self._file.close()
        os.unlink(self._temporary)


class _FileReader:
    def __init__(self, path: str) -> None:
        self._path = path
        self._file: io.BufferedReader = open(path, "rb")  # noqa: SIM115 - closed in close()
        size = self._file.seek(0, os.SEEK_END)
        if size < len(_MAGIC) + _FOOTER.size:
            self._corrupt(size, "it is too short")
        self._file.seek(size - _FOOTER.size)
        self.count, offsets_position, magic = _FOOTER.unpack(self._file.read(_FOOTER.size))
        if magic != _MAGIC or offsets_position + 8 * self.count != size - _FOOTER.size:
            self._corrupt(size - _FOOTER.size, "its footer is not a shardflow cache footer")
        self._file.seek(offsets_position)
        self._offsets = np.frombuffer(self._file.read(8 * self.count), dtype="<i8").tolist()

    def _corrupt(self, offset: int, why: str) -> NoReturn:
        from shardflow.data.sources.errors import DataLossError

        self._file.close()
        raise DataLossError(self._path, offset, f"not a whole shardflow cache file ({why}); delete it to rebuild")

    def get(self, index: int) -> Any:
        self._file.seek(self._offsets[index])
        header_length, payload_length = _RECORD_HEAD.unpack(self._file.read(_RECORD_HEAD.size))
        spec = msgpack.unpackb(self._file.read(header_length))
        payload = bytearray(payload_length)
        if self._file.readinto(payload) != payload_length:
            self._corrupt(self._offsets[index], "a record is truncated")
        # The payload is this element's own buffer, so its arrays can be views of it.
        return codec.decode(spec, memoryview(payload), 0, copy=False)

    def close(self) -> None:
        self._file.close()


class _CacheIterator(DatasetIterator[Any]):
    """Reads the cache when it is complete, else fills it from the input. State: the mode and the position,
    plus the input's state for a fill. A pass restored from the middle of a fill passes elements through without
    caching them (the next complete pass fills the cache)."""

    def __init__(self, dataset: CacheDataset) -> None:
        self._dataset = dataset
        self._scope = IterationScope()
        self._reader = dataset._open_reader()
        self._input: DatasetIterator[Any] | None = None
        self._writer: _MemoryWriter | _FileWriter | None = None
        if self._reader is None:
            self._input = iter(dataset._input)
            self._writer = dataset._open_writer()
        self._index = 0

    def __next__(self) -> Any:
        if self._reader is not None:
            if self._index >= self._reader.count:
                raise StopIteration
            self._index += 1
            return self._reader.get(self._index - 1)
        assert self._input is not None
        try:
            element = next(self._input)
        except StopIteration:
            if self._writer is not None:
                self._writer.finish()
                self._writer = None
            raise
        if self._writer is not None:
            self._writer.append(element)
        self._index += 1
        return element

    @property
    def deterministic(self) -> bool:
        return self._input is None or self._input.deterministic

    def get_state(self) -> State:
        if self._reader is not None:
            return {"mode": "read", "index": self._index}
        assert self._input is not None
        return {"mode": "fill", "index": self._index, "input": self._input.get_state()}

    def set_state(self, state: State) -> None:
        self.close()
        self._index = int(state["index"])
        if state["mode"] == "read":
            self._reader = self._dataset._open_reader() or self._rebuild()
            return
        self._input = self._scope.iter(self._dataset._input)
        self._input.set_state(state["input"])

    def _rebuild(self) -> _MemoryReader | _FileReader:
        """A memory cache read in another process (or a deleted file): fill it with a full pass first."""
        writer = self._dataset._open_writer()
        source = self._scope.iter(self._dataset._input)
        try:
            for element in source:
                writer.append(element)
        except BaseException:
            writer.abandon()
            raise
        finally:
            source.close()
        writer.finish()
        reader = self._dataset._open_reader()
        assert reader is not None
        return reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._writer is not None:
            self._writer.abandon()
            self._writer = None
        if self._input is not None:
            self._input.close()
            self._input = None
