"""The CRCs of TFRecord framing, checked for a whole chunk of records with one pass of CRC-32C over it."""

from __future__ import annotations

import struct

import google_crc32c
import numpy as np

from shardflow.data.arrays import Int64Array, distinct

HEADER_BYTES = 12  # length (uint64 little-endian), masked CRC of the length
FOOTER_BYTES = 4  # masked CRC of the data
_LENGTH = struct.Struct("<Q")
_MASK_DELTA = 0xA282EAD8
# crc32c of n zero bytes, by n: records of a file have few distinct sizes.
_zero_crcs: dict[int, int] = {}
_MAX_CACHED_ZERO_CRCS = 4096


def masked_crc32c(data: bytes) -> int:
    """CRC-32C rotated and offset as TFRecord stores it, so that a CRC of data holding CRCs stays strong."""
    crc: int = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _unmask(masked: np.ndarray) -> np.ndarray:
    rotated = masked - np.uint32(_MASK_DELTA)
    return (rotated >> 17) | (rotated << 15)


def all_intact(data: bytes, ends: Int64Array) -> bool:
    """Whether every record framed in `data` (the first one at 0, each ending at `ends`) has the right length CRC
    and data CRC.

    CRC-32C without its initial and final inversion ("raw") is linear: raw(a + b) is raw(a) shifted by len(b)
    xor raw(b), and a message followed by its own raw CRC (little-endian) has raw CRC 0. Each stored CRC, unmasked,
    claims crc32c(m) = raw(m) xor crc32c(len(m) zero bytes); turned into the raw CRC it claims and written over itself
    in a copy of the chunk, it makes the raw CRC of the whole copy 0 when every length and data are intact. One
    corrupt record makes it non-zero exactly when its own check would fail (the shift is invertible); corruption in
    several escapes with the odds of any 32-bit CRC. One C call over the chunk replaces two per record; the caller
    checks record by record only to find the bad one."""
    if not ends.size:
        return True
    starts = np.concatenate(([0], ends[:-1]))
    copy = bytearray(memoryview(data)[: int(ends[-1])])
    # words[i] is the little-endian uint32 at byte i of the copy (an unaligned view).
    words = np.ndarray((len(copy) - 3,), dtype="<u4", buffer=copy, strides=(1,))
    length_crc_at, data_crc_at = starts + 8, ends - FOOTER_BYTES
    words[length_crc_at] = _unmask(words[length_crc_at]) ^ np.uint32(_zero_crc(8))
    sizes, which = distinct(ends - starts - HEADER_BYTES - FOOTER_BYTES)
    zero_crcs = np.array([_zero_crc(size) for size in sizes.tolist()], dtype=np.uint32)
    words[data_crc_at] = _unmask(words[data_crc_at]) ^ zero_crcs[which]
    # Starting from 0xFFFFFFFF, extend() runs the raw CRC and returns it inverted.
    return google_crc32c.extend(0xFFFFFFFF, bytes(copy)) == 0xFFFFFFFF  # type: ignore[no-any-return]


def _zero_crc(size: int) -> int:
    crc = _zero_crcs.get(size)
    if crc is None:
        if len(_zero_crcs) >= _MAX_CACHED_ZERO_CRCS:
            _zero_crcs.clear()
        crc = _zero_crcs[size] = google_crc32c.value(bytes(size))
    return crc


def first_corrupt(data: bytes, starts: list[int], ends: list[int]) -> tuple[int, str]:
    """The index of the first record whose length or data fails its CRC, and what is wrong with it (when
    `all_intact` said that one does)."""
    for index, (start, end) in enumerate(zip(starts, ends, strict=True)):
        length_crc, data_crc = struct.unpack_from("<I", data, start + 8)[0], struct.unpack_from("<I", data, end - 4)[0]
        if masked_crc32c(data[start : start + 8]) != length_crc:
            return index, "corrupted length (CRC mismatch)"
        if masked_crc32c(data[start + HEADER_BYTES : end - FOOTER_BYTES]) != data_crc:
            return index, "corrupted data (CRC mismatch)"
    raise AssertionError("the chunk's CRC check failed but every record's passes")
