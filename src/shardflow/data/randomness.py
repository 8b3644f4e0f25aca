"""Seeded random streams whose position is a count, so that an iterator's state restores them exactly."""

from __future__ import annotations

import secrets

import numpy as np
import numpy.typing as npt

SEED_MASK = (1 << 63) - 1

# Words are generated in blocks, each from its own generator seeded by (seed, *epochs, block number): seeking to a
# position regenerates one block instead of replaying the stream from its start.
_BLOCK_WORDS = 1024
_UNIT = 2.0**-53


def resolve_seed(seed: int | None) -> int:
    """`seed` as a non-negative 63-bit int; None draws one, which the iterator states then record."""
    return secrets.randbits(63) if seed is None else int(seed) & SEED_MASK


class RandomStream:
    """64-bit random words determined by `entropy` (the seed, the epochs and a tag per op). `peek` looks ahead
    without moving; `advance` moves past what was used; `position` is the number of words used."""

    def __init__(self, entropy: tuple[int, ...]) -> None:
        self.entropy = entropy
        self.position = 0
        self._block_index = -1
        self._block: npt.NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
        # The uniforms of one block as Python floats, for draws one at a time without numpy calls.
        self._uniforms_index = -1
        self._uniforms: list[float] = []

    def _load(self, block_index: int) -> npt.NDArray[np.uint64]:
        if block_index != self._block_index:
            self._block = np.random.PCG64([*self.entropy, block_index]).random_raw(_BLOCK_WORDS)
            self._block_index = block_index
        return self._block

    def peek(self, count: int) -> npt.NDArray[np.uint64]:
        """The next `count` words, without moving."""
        parts = []
        position, end = self.position, self.position + count
        while position < end:
            block_index, offset = divmod(position, _BLOCK_WORDS)
            take = min(end - position, _BLOCK_WORDS - offset)
            parts.append(self._load(block_index)[offset : offset + take])
            position += take
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else self._block[:0]

    def peek_uniform(self, count: int) -> npt.NDArray[np.float64]:
        """The next `count` words as floats uniform in [0, 1), without moving."""
        return (self.peek(count) >> np.uint64(11)).astype(np.float64) * _UNIT

    def advance(self, count: int) -> None:
        self.position += count

    def uniform(self) -> float:
        """The next word as a float uniform in [0, 1), and moves past it."""
        block_index, offset = divmod(self.position, _BLOCK_WORDS)
        if block_index != self._uniforms_index:
            self._uniforms = ((self._load(block_index) >> np.uint64(11)).astype(np.float64) * _UNIT).tolist()
            self._uniforms_index = block_index
        self.position += 1
        return self._uniforms[offset]
