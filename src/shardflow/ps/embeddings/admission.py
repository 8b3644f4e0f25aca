"""Which ids of a dynamic table get a row: counted sightings (admission after k) or a reproducible draw per sighting
(admission with probability p); and the ids waiting for admission in checkpoints."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardflow.ps.embeddings.files import PENDING
from shardflow.ps.embeddings.hash_index import RowMap
from shardflow.ps.embeddings.init import table_key, uniform_draws
from shardflow.ps.embeddings.spec import TableSpec, owners

PENDING_SOURCE = PENDING + "source"
"""(ps_index, num_ps) of the PS whose ids waiting for admission a state holds."""
_ADMISSION_SALT = 0x2545F4914F6CDD1D


class Sightings:
    """Decides which ids without a row get one. With admit_probability p, each sighting admits with probability p,
    by a draw keyed by (seed, table, id, step): reproducible, and nothing kept. With admit_after k > 1, an exact
    count per id not yet admitted, in a RowMap of at most `max_pending_ids` ids (default: capacity_per_ps, else
    2**20), about 100 bytes each; beyond, the ids seen least recently are forgotten (their count starts again)."""

    def __init__(self, spec: TableSpec, max_pending_ids: int | None) -> None:
        self._spec = spec
        self._key = table_key(spec) ^ _ADMISSION_SALT
        counting = spec.admit_probability is None and spec.admit_after > 1
        self._pending = RowMap() if counting else None
        self._max_pending = max_pending_ids or spec.max_pending_per_ps or spec.capacity_per_ps or 1 << 20

    def admit(self, ids: torch.Tensor, counts: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For distinct ids without a row, seen `counts` times at `step`: whether each is admitted now, and its
        sightings so far."""
        probability = self._spec.admit_probability
        if probability is not None:
            draws = uniform_draws(self._key, ids, torch.full_like(ids, step))
            return draws < 1 - (1 - probability) ** counts.to(torch.float64), counts
        if self._pending is None:
            return torch.ones_like(ids, dtype=torch.bool), counts
        pending = self._pending
        rows = pending.find(ids)
        absent = rows < 0
        rows[absent] = pending.add(ids[absent])
        pending.counts[rows] += counts
        pending.last_seen[rows] = step
        sightings = pending.counts[rows]
        admitted = sightings >= self._spec.admit_after
        pending.remove(rows[admitted])
        if len(pending) > self._max_pending:
            live = pending.live_rows()
            keep = self._max_pending - self._max_pending // 8
            pending.remove(live[least_valued(pending.ids[live], len(pending) - keep, pending.last_seen[live])])
        return admitted, sightings

    def state(self, source: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ids waiting for admission with their sightings, sorted by id, and `source`: (ps_index, num_ps) of
        the PS that holds them, whose whole set they are (see `load`)."""
        if self._pending is None:
            return {}
        pending = self._pending
        live = pending.live_rows()
        live = live[torch.argsort(pending.ids[live])]
        return {
            PENDING_SOURCE: source,
            "pending.ids": pending.ids[live],
            "pending.counts": pending.counts[live],
            "pending.last_seen": pending.last_seen[live],
        }

    def load(self, state: dict[str, torch.Tensor], owned: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Take the waiting ids of `state` that this PS `owned`, in place of those it holds of the same source (the
        PS that wrote them): a later file of that PS holds its whole set then."""
        pending = self._pending
        if pending is None:
            return
        source_ps, source_num_ps = (int(v) for v in state[PENDING_SOURCE].tolist())
        live = pending.live_rows()
        pending.remove(live[owners(self._spec, pending.ids[live], source_num_ps) == source_ps])
        ids = state["pending.ids"]
        mine = owned(ids)
        rows = pending.add(ids[mine])
        pending.counts[rows] = state["pending.counts"][mine]
        pending.last_seen[rows] = state["pending.last_seen"][mine]

    def forget_unseen_since(self, step: int) -> None:
        if self._pending is not None:
            live = self._pending.live_rows()
            self._pending.remove(live[self._pending.last_seen[live] < step])

    def memory_bytes(self) -> int:
        return 0 if self._pending is None else self._pending.memory_bytes()


def least_valued(ids: torch.Tensor, count: int, first: torch.Tensor, then: torch.Tensor | None = None) -> torch.Tensor:
    """The positions of the `count` smallest by `first`, then by `then` (both non-negative int64), then by id: the
    same choice however the rows lie in storage (a restored table evicts what the live one would)."""
    key = first if then is None else first.clamp(max=2**30) * 2**33 + then.clamp(0, 2**33 - 1)
    if count <= 0:
        return torch.empty(0, dtype=torch.int64)
    if count >= key.numel():
        return torch.arange(key.numel())
    threshold = key.kthvalue(count).values
    below = (key < threshold).nonzero()[:, 0]
    tied = (key == threshold).nonzero()[:, 0]
    by_id = torch.topk(ids[tied], count - below.numel(), largest=False).indices
    return torch.cat((below, tied[by_id]))
