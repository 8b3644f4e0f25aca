"""An int64 -> int64 hash map held in two tensors and probed for a whole batch of ids at once: open addressing with
linear probing, one vectorised step per probing round; and RowMap, which gives each id a storage row with it, as
a dynamic table's rows and its pending sightings have."""

from __future__ import annotations

import torch

from shardflow.ps.embeddings.spec import mix

_EMPTY = -1
_TOMBSTONE = -2
_SALT = 0x5BD1E9955BD1E995
"""Keeps the buckets independent of `owners` (mix(id) % num_ps): on one PS all ids share that residue, and taken
unsalted, an even num_ps would leave every other bucket without a home id."""
_MAX_LOAD = 0.5
"""Live entries and tombstones together never fill more buckets than this: probes stay short (about 2.5 buckets
for an absent id)."""
_MIN_BUCKETS = 16


class HashIndex:
    """Maps distinct int64 ids (any int64) to non-negative int64 slots. A bucket is an id and a slot, the slot also
    marking a bucket empty (-1) or removed (-2, a tombstone, so that probing continues past it)."""

    def __init__(self, num_buckets: int = _MIN_BUCKETS) -> None:
        self._keys, self._slots = _buckets(_power_of_two(max(num_buckets, _MIN_BUCKETS)))
        self._num_live = 0
        self._num_tombstones = 0

    def __len__(self) -> int:
        return self._num_live

    @property
    def num_buckets(self) -> int:
        return self._keys.numel()

    def memory_bytes(self) -> int:
        return self._keys.numel() * self._keys.element_size() + self._slots.numel() * self._slots.element_size()

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it has none."""
        buckets = self._buckets_of(ids)
        found = torch.full_like(ids, _EMPTY)
        hit = buckets >= 0
        found[hit] = self._slots[buckets[hit]]
        return found

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Adds ids that are distinct and not in the index, with slots >= 0 (neither is checked: callers find first)."""
        self._make_room(ids.numel())
        mask = self.num_buckets - 1
        pending = torch.arange(ids.numel())
        bucket = _home(ids, mask)
        while pending.numel():
            ids_pending = ids[pending]
            free = self._slots[bucket] < 0
            # Every id writes itself into its free bucket; where several chose the same one, one write lands, and
            # that id takes the bucket. The others probe on (ids are distinct, so exactly one reads itself back).
            self._keys[bucket[free]] = ids_pending[free]
            won = free & (self._keys[bucket] == ids_pending)
            taken = bucket[won]
            self._num_tombstones -= int((self._slots[taken] == _TOMBSTONE).sum())
            self._slots[taken] = slots[pending[won]]
            lost = ~won
            pending, bucket = pending[lost], (bucket[lost] + 1) & mask
        self._num_live += ids.numel()

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Removes the ids that are in the index and returns the slot each had, -1 for those absent."""
        buckets = self._buckets_of(ids)
        removed = torch.full_like(ids, _EMPTY)
        hit = buckets >= 0
        removed[hit] = self._slots[buckets[hit]]
        gone = torch.unique(buckets[hit])  # an id given twice is removed once
        self._slots[gone] = _TOMBSTONE
        self._num_live -= gone.numel()
        self._num_tombstones += gone.numel()
        return removed

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every id in the index and its slot, in bucket order."""
        live = self._slots >= 0
        return self._keys[live], self._slots[live]

    def _buckets_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The bucket holding each id, -1 where none does: probe from the home bucket until the id or an empty one."""
        mask = self.num_buckets - 1
        result = torch.full_like(ids, _EMPTY)
        pending = torch.arange(ids.numel())
        bucket = _home(ids, mask)
        ids_pending = ids
        while pending.numel():
            slots = self._slots[bucket]
            hit = (slots >= 0) & (self._keys[bucket] == ids_pending)
            result[pending[hit]] = bucket[hit]
            going_on = ~hit & (slots != _EMPTY)
            pending, bucket, ids_pending = pending[going_on], (bucket[going_on] + 1) & mask, ids_pending[going_on]
        return result

    def _make_room(self, incoming: int) -> None:
        """Rebuilds, without tombstones, once live entries, tombstones and `incoming` would pass the load factor;
        grows so that the live ones then fill at most half of it, the next rebuild being as far off as possible."""
        if self._num_live + self._num_tombstones + incoming <= _MAX_LOAD * self.num_buckets:
            return
        num_buckets = self.num_buckets
        while self._num_live + incoming > _MAX_LOAD / 2 * num_buckets:
            num_buckets *= 2
        ids, slots = self.items()
        self._keys, self._slots = _buckets(num_buckets)
        self._num_live = self._num_tombstones = 0
        self.insert(ids, slots)


class RowMap:
    """Distinct int64 ids, each given a row of storage that the caller keeps alongside (values, slots): a HashIndex
    from id to row, a free list of rows, and per row its id, sightings (`counts`) and the step it was `last_seen`,
    which the caller sets. The rows grow by doubling; freed ones are reused first."""

    def __init__(self) -> None:
        self._index = HashIndex()
        self.ids = torch.empty(0, dtype=torch.int64)
        self.counts = torch.empty(0, dtype=torch.int64)
        self.last_seen = torch.empty(0, dtype=torch.int64)
        self._live = torch.empty(0, dtype=torch.bool)
        self._free = torch.empty(0, dtype=torch.int64)
        """Free rows in its first `_num_free` places, the next to take last."""
        self._num_free = 0

    def __len__(self) -> int:
        return len(self._index)

    @property
    def capacity(self) -> int:
        """Rows there is storage for: the caller's tensors must have as many."""
        return self.ids.numel()

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The row of each id, -1 where it has none."""
        return self._index.find(ids)

    def add(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for distinct ids that have none (counts and last_seen 0), growing `capacity` when they run out."""
        if self._num_free < ids.numel():
            self._grow(ids.numel())
        self._num_free -= ids.numel()
        rows = self._free[self._num_free : self._num_free + ids.numel()].clone()
        self._index.insert(ids, rows)
        self.ids[rows] = ids
        self.counts[rows] = 0
        self.last_seen[rows] = 0
        self._live[rows] = True
        return rows

    def remove(self, rows: torch.Tensor) -> torch.Tensor:
        """Frees distinct rows that hold an id; the ids they held."""
        ids = self.ids[rows]
        self._index.remove(ids)
        self._live[rows] = False
        self._free[self._num_free : self._num_free + rows.numel()] = rows
        self._num_free += rows.numel()
        return ids

    def live_rows(self) -> torch.Tensor:
        """Every row that holds an id, in row order."""
        return self._live.nonzero()[:, 0]

    def memory_bytes(self) -> int:
        tensors = (self.ids, self.counts, self.last_seen, self._live, self._free)
        return self._index.memory_bytes() + sum(t.numel() * t.element_size() for t in tensors)

    def _grow(self, needed: int) -> None:
        old = self.capacity
        capacity = max(old, _MIN_BUCKETS)
        while capacity - len(self) < needed:
            capacity *= 2
        for name in ("ids", "counts", "last_seen", "_live"):
            tensor = getattr(self, name)
            bigger = tensor.new_zeros(capacity)
            bigger[:old] = tensor
            setattr(self, name, bigger)
        # The new rows go under the old free ones, which are taken first; the lowest new row is taken next.
        free = torch.empty(capacity, dtype=torch.int64)
        free[: capacity - old] = torch.arange(capacity - 1, old - 1, -1)
        free[capacity - old : capacity - old + self._num_free] = self._free[: self._num_free]
        self._free = free
        self._num_free += capacity - old


def _buckets(num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(num_buckets, dtype=torch.int64), torch.full((num_buckets,), _EMPTY, dtype=torch.int64)


def _home(ids: torch.Tensor, mask: int) -> torch.Tensor:
    return mix(ids ^ _SALT) & mask


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
