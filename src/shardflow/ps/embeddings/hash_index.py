"""An int64 -> int64 hash map held in one tensor and probed for a whole batch of ids at once: open addressing with
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
_REBUILT_LOAD = 0.375
"""A rebuild leaves at most this load: at least an eighth of the buckets before the next one."""
_WINDOW = 4
"""Buckets read at once per id after its home bucket: 64 bytes, a cache line."""
_MIN_BUCKETS = 16


class HashIndex:
    """Maps distinct int64 ids (any int64) to non-negative int64 slots. A bucket is an id and a slot side by side
    (one cache line read finds both), the slot also marking a bucket empty (-1) or removed (-2, a tombstone, so
    that probing continues past it)."""

    def __init__(self, num_buckets: int = _MIN_BUCKETS) -> None:
        self._buckets = _empty_buckets(_power_of_two(max(num_buckets, _MIN_BUCKETS)))
        self._num_live = 0
        self._num_tombstones = 0

    def __len__(self) -> int:
        return self._num_live

    @property
    def num_buckets(self) -> int:
        return self._buckets.shape[0]

    def memory_bytes(self) -> int:
        return self._buckets.numel() * self._buckets.element_size()

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it has none."""
        return self._probe(ids)[1]

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Adds ids that are distinct and not in the index, with slots >= 0 (neither is checked: callers find first)."""
        self._make_room(ids.numel())
        flat = self._buckets.view(-1)
        pending = torch.arange(ids.numel())
        bucket = _home(ids, self.num_buckets - 1)
        ids_pending = ids
        while pending.numel():
            bucket = self._first_free(bucket)
            # Every id writes itself into its free bucket; where several chose the same one, one write lands, and
            # that id takes the bucket. The others probe on past it (ids are distinct: one reads itself back).
            flat[2 * bucket] = ids_pending
            won = flat.index_select(0, 2 * bucket) == ids_pending
            taken = 2 * bucket[won] + 1
            self._num_tombstones -= int((flat.index_select(0, taken) == _TOMBSTONE).sum())
            flat[taken] = slots[pending[won]]
            lost = (~won).nonzero()[:, 0]
            pending, ids_pending = pending.index_select(0, lost), ids_pending.index_select(0, lost)
            bucket = (bucket.index_select(0, lost) + 1) & (self.num_buckets - 1)
        self._num_live += ids.numel()

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Removes the ids that are in the index and returns the slot each had, -1 for those absent."""
        buckets, slots = self._probe(ids)
        gone = torch.unique(buckets[buckets >= 0])  # an id given twice is removed once
        self._buckets[gone, 1] = _TOMBSTONE
        self._num_live -= gone.numel()
        self._num_tombstones += gone.numel()
        return slots

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every id in the index and its slot, in bucket order."""
        live = self._buckets[self._buckets[:, 1] >= 0]
        return live[:, 0].contiguous(), live[:, 1].contiguous()

    def _probe(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket holding each id and its slot, -1 and -1 where none does: each id probes from its home bucket
        on until it finds itself or an empty bucket. Most are decided at their home bucket; the rest read a
        window of buckets a round, so that a batch takes few rounds whatever its longest probe."""
        mask = self.num_buckets - 1
        home = _home(ids, mask)
        keys, slots = self._buckets.index_select(0, home).unbind(1)
        hit = (keys == ids) & (slots >= 0)
        found_buckets, found_slots = torch.where(hit, home, _EMPTY), torch.where(hit, slots, _EMPTY)
        pending = (~hit & (slots != _EMPTY)).nonzero()[:, 0]
        ids_pending, start = ids.index_select(0, pending), (home.index_select(0, pending) + 1) & mask
        while pending.numel():
            buckets = (start.unsqueeze(1) + torch.arange(_WINDOW)) & mask
            entries = self._buckets.index_select(0, buckets.view(-1)).view(-1, _WINDOW, 2)
            slots = entries[..., 1]
            hit = (slots >= 0) & (entries[..., 0] == ids_pending.unsqueeze(1))
            stop = hit | (slots == _EMPTY)
            # No id is stored past an empty bucket on its probe sequence: the first stop decides.
            first = stop.to(torch.uint8).argmax(dim=1, keepdim=True)
            found = hit.gather(1, first)[:, 0].nonzero()[:, 0]
            where = pending.index_select(0, found)
            found_buckets[where] = buckets.gather(1, first)[:, 0].index_select(0, found)
            found_slots[where] = slots.gather(1, first)[:, 0].index_select(0, found)
            going_on = (~stop.any(dim=1)).nonzero()[:, 0]
            pending, ids_pending = pending.index_select(0, going_on), ids_pending.index_select(0, going_on)
            start = (start.index_select(0, going_on) + _WINDOW) & mask
        return found_buckets, found_slots

    def _first_free(self, start: torch.Tensor) -> torch.Tensor:
        """The first empty or removed bucket from each of `start` on."""
        mask = self.num_buckets - 1
        result = start.clone()
        pending = torch.arange(start.numel())
        while pending.numel():
            buckets = (start.unsqueeze(1) + torch.arange(_WINDOW)) & mask
            free = self._buckets.view(-1).index_select(0, 2 * buckets.view(-1) + 1).view(-1, _WINDOW) < 0
            first = free.to(torch.uint8).argmax(dim=1, keepdim=True)
            result[pending] = buckets.gather(1, first)[:, 0]
            going_on = (~free.any(dim=1)).nonzero()[:, 0]
            pending, start = pending.index_select(0, going_on), (start.index_select(0, going_on) + _WINDOW) & mask
        return result

    def _make_room(self, incoming: int) -> None:
        """Rebuilds, without tombstones, once live entries, tombstones and `incoming` would fill more than half the
        buckets, doubling them until the live ones and `incoming` fill at most 3/8: the next rebuild is then at
        least an eighth of the buckets away, however many ids come and go."""
        if self._num_live + self._num_tombstones + incoming <= _MAX_LOAD * self.num_buckets:
            return
        num_buckets = self.num_buckets
        while self._num_live + incoming > _REBUILT_LOAD * num_buckets:
            num_buckets *= 2
        ids, slots = self.items()
        self._buckets = _empty_buckets(num_buckets)
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


def _empty_buckets(num_buckets: int) -> torch.Tensor:
    buckets = torch.zeros((num_buckets, 2), dtype=torch.int64)
    buckets[:, 1] = _EMPTY
    return buckets


def _home(ids: torch.Tensor, mask: int) -> torch.Tensor:
    return mix(ids ^ _SALT) & mask


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
