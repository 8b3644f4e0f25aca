"""Filename arguments, compression types, and chunked reads of plain, GZIP and ZLIB files."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from typing import BinaryIO

import numpy as np

from shardflow.data.errors import DataLossError, NotFoundError, PermissionDeniedError

DEFAULT_BUFFER_SIZE = 256 * 1024
"""Bytes read per chunk when a source is given no buffer_size."""

# zlib window bits per compression_type: 31 reads a gzip header and trailer, 15 a zlib one.
_WINDOW_BITS = {"": 0, "GZIP": 31, "ZLIB": 15}


def filename_list(filenames: object) -> list[str]:
    """The files named by a str, bytes or os.PathLike, a list or tuple of them, or a numpy array of names."""
    if isinstance(filenames, np.ndarray):
        return [_filename(name) for name in filenames.reshape(-1).tolist()]
    if isinstance(filenames, str | bytes | os.PathLike | np.generic):
        return [_filename(filenames)]
    if isinstance(filenames, Iterable):
        names = [_filename(name) for name in filenames]
        if not names:
            raise ValueError("filenames is empty: expected at least one file name")
        return names
    raise TypeError(f"filenames must be a str, bytes, a list of them or a numpy array of them, got {type(filenames)}")


def _filename(name: object) -> str:
    if isinstance(name, np.ndarray | np.generic):
        name = name.item()
    if isinstance(name, bytes):
        return name.decode()
    if isinstance(name, str | os.PathLike):
        return os.fspath(name)
    raise TypeError(f"a file name must be a str or bytes, got {type(name)}: {name!r}")


def compression_type_name(compression_type: str | None) -> str:
    """Validate tf.data's compression_type argument: None or "" (plain), "GZIP" or "ZLIB"."""
    name = compression_type or ""
    if name not in _WINDOW_BITS:
        raise ValueError(f"compression_type must be None, '', 'GZIP' or 'ZLIB', got {compression_type!r}")
    return name


def open_to_read(filename: str) -> BinaryIO:
    """`open(filename, "rb")`, raising tf.errors' names: NotFoundError (a FileNotFoundError) for a missing file and
    PermissionDeniedError (a PermissionError) for an unreadable one."""
    try:
        return open(filename, "rb")  # the caller closes it
    except FileNotFoundError as error:
        raise NotFoundError(error.errno, error.strerror, filename) from None
    except PermissionError as error:
        raise PermissionDeniedError(error.errno, error.strerror, filename) from None


class ByteStream:
    """The uncompressed bytes of one file, read in chunks; `offset` counts uncompressed bytes returned so far.

    Compressed streams cannot seek: starting at an offset decompresses from the file's start and drops bytes.
    """

    def __init__(
        self, filename: str, compression_type: str | None = None, buffer_size: int | None = None, offset: int = 0
    ) -> None:
        if buffer_size is not None and buffer_size <= 0:
            raise ValueError(f"buffer_size must be positive, got {buffer_size}")
        self.filename = filename
        self.offset = 0
        self._buffer_size = buffer_size or DEFAULT_BUFFER_SIZE
        self._window_bits = _WINDOW_BITS[compression_type_name(compression_type)]
        self._decompressor = zlib.decompressobj(self._window_bits) if self._window_bits else None
        self._pushed_back = b""
        self._file = open_to_read(filename)
        if offset:
            self._skip_to(offset)

    def read_chunk(self, min_size: int = 1) -> bytes:
        """The next bytes of the stream: at least `min_size` of them unless the stream ends first; b"" at its end."""
        chunk = self._read()
        if len(chunk) < min_size and chunk:
            pieces = [chunk]
            size = len(chunk)
            while size < min_size and (piece := self._read()):
                pieces.append(piece)
                size += len(piece)
            chunk = b"".join(pieces)
        self.offset += len(chunk)
        return chunk

    def close(self) -> None:
        self._file.close()

    def _read(self) -> bytes:
        if self._pushed_back:
            data, self._pushed_back = self._pushed_back, b""
            return data
        try:
            if self._decompressor is None:
                return self._file.read(self._buffer_size)
            return self._decompress(self._decompressor)
        except zlib.error as error:
            raise DataLossError(self.filename, self.offset, f"corrupt compressed stream ({error})") from None
        except OSError as error:
            if error.filename is not None:
                raise
            # A failing disk or network file system: the error says which file, and how far reading had come.
            strerror = f"{error.strerror or error} at byte offset {self.offset}"
            raise OSError(error.errno, strerror, self.filename) from error

    def _decompress(self, decompressor: zlib._Decompress) -> bytes:
        while True:
            if decompressor.unconsumed_tail:
                data = decompressor.decompress(decompressor.unconsumed_tail, self._buffer_size)
            elif decompressor.eof:
                # Concatenated gzip members (as `cat a.gz b.gz` makes) are one stream.
                rest = decompressor.unused_data or self._file.read(self._buffer_size)
                if not rest:
                    return b""
                decompressor = self._decompressor = zlib.decompressobj(self._window_bits)
                data = decompressor.decompress(rest, self._buffer_size)
            else:
                compressed = self._file.read(self._buffer_size)
                if not compressed:
                    raise DataLossError(self.filename, self.offset, "truncated compressed stream")
                data = decompressor.decompress(compressed, self._buffer_size)
            if data:
                return data

    def _skip_to(self, offset: int) -> None:
        if self._decompressor is None:
            if os.fstat(self._file.fileno()).st_size < offset:
                raise DataLossError(self.filename, offset, "the file ends before this saved or header position")
            self._file.seek(offset)
            self.offset = offset
            return
        while self.offset < offset:
            chunk = self.read_chunk()
            if not chunk:
                raise DataLossError(self.filename, self.offset, "the stream ends before this saved or header position")
            if self.offset > offset:
                # Keep the part of the chunk past the saved position for the next read.
                self._pushed_back = chunk[len(chunk) - (self.offset - offset) :]
                self.offset = offset
