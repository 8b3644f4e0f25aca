"""One PS's part of one `sf.nn` table: its rows, their optimizer slots, lookups, updates and checkpoint state. A
fixed table holds every row it owns from the start; a dynamic one makes rows on admission, and expires and evicts
them."""

from __future__ import annotations

import torch

from shardflow.ps.embeddings.admission import PENDING_SOURCE, Sightings, least_valued
from shardflow.ps.embeddings.hash_index import RowMap
from shardflow.ps.embeddings.init import initial_rows
from shardflow.ps.embeddings.row_optimizers import SlotLayout, apply_update, new_slots, slot_layouts
from shardflow.ps.embeddings.spec import RowOptimizer, TableSpec, global_ids, local_rows, num_local_rows, owners

_INIT_CHUNK_ROWS = 1 << 20
"""A fixed table's rows are initialised this many at a time, so that only their global ids are extra memory."""
"""Separates the admission draws from the initial values' (both are keyed by the table and the id)."""
_EVICTION_SLACK = 64
"""Over capacity, a table evicts down to capacity - capacity // 64: the scan over every row then runs once per
capacity // 64 admissions, not at every step."""


class ShardTable:
    """PS `ps_index` of `num_ps`'s rows of `spec`'s table, updated by `optimizer`. A fixed table allocates all its
    rows and their slots at once (eagerly: the slots are as large as the values, and every row trains). A dynamic
    table finds its rows through a HashIndex, grows its storage by doubling and reuses freed rows."""

    def __init__(
        self,
        spec: TableSpec,
        optimizer: RowOptimizer,
        ps_index: int,
        num_ps: int,
        *,
        max_pending_ids: int | None = None,
    ) -> None:
        self.spec = spec
        self.optimizer = optimizer
        self.ps_index = ps_index
        self.num_ps = num_ps
        self.optimizer_step = 0
        """Updates applied, as torch's optimizers count steps: once per apply, touched rows or not."""
        self._layouts = slot_layouts(optimizer, spec.embedding_dim)
        self._padding_id = _padding_id(spec)
        self._counters = dict.fromkeys(("admitted", "rejected", "evicted", "expired"), 0)
        if spec.dynamic:
            self._rows: RowMap | None = RowMap()
            self._sightings = Sightings(spec, max_pending_ids)
            self._removed: list[torch.Tensor] = []
            self._next_expiry_check = 0
            num_rows = 0
        else:
            self._rows = None
            num_rows = num_local_rows(spec, ps_index, num_ps)
        self._values = torch.empty((num_rows, spec.embedding_dim), dtype=torch.float32)
        self._slots = new_slots(self._layouts, num_rows)
        self._changed = torch.zeros(num_rows, dtype=torch.bool)
        if not spec.dynamic:
            self._initialise_fixed_rows()

    def check_ids(self, ids: torch.Tensor, what: str) -> None:
        """Raise ValueError, naming `what`, the table and the first bad id, unless `ids` is a 1-D int64 tensor of
        ids this PS owns (and, in a fixed table, in [0, num_embeddings))."""
        name = self.spec.name
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(
                f"{what}: table {name!r} takes ids as a 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}"
            )
        size = self.spec.num_embeddings
        if size is not None and ids.numel():
            low, high = (int(bound) for bound in torch.aminmax(ids))  # one pass; the first bad id only if there is one
            if low < 0 or high >= size:
                bad = int(ids[(ids < 0) | (ids >= size)][0])
                raise ValueError(f"{what}: table {name!r} has ids 0 to {size - 1}, got id {bad}")
        if self.num_ps > 1:
            owner = owners(self.spec, ids, self.num_ps)
            elsewhere = owner != self.ps_index
            if bool(elsewhere.any()):
                first = int(elsewhere.nonzero()[0, 0])
                raise ValueError(
                    f"{what}: table {name!r}: id {int(ids[first])} belongs to PS {int(owner[first])}, not to PS "
                    f"{self.ps_index} of {self.num_ps}"
                )

    def lookup(self, ids: torch.Tensor, *, checked: bool = False) -> torch.Tensor:
        """The rows of `ids` (a fresh [n, dim] tensor). A dynamic table's ids without a row read their initial values
        (no row is made, nothing counted); the padding id reads zeros; with max_norm, the stored rows are
        renormalised in place first, as torch.nn.functional.embedding does. `checked`: the caller has passed `ids`
        through `check_ids` already."""
        if not checked:
            self.check_ids(ids, "lookup")
        if self._rows is None:
            rows = local_rows(self.spec, ids, self.ps_index, self.num_ps)
            self._renormalise(rows)
            out = self._values.index_select(0, rows)
        else:
            out = self._lookup_dynamic(ids)
        if self._padding_id is not None:
            out[ids == self._padding_id] = 0.0
        return out

    def apply(
        self,
        ids: torch.Tensor,
        counts: torch.Tensor,
        grads: torch.Tensor,
        *,
        step: int,
        lr: float | None = None,
        scale: float = 1.0,
        checked: bool = False,
    ) -> None:
        """Applies one update: `grads` [n, dim] of `ids` [n] (repeats allowed: several pushes concatenated), seen
        `counts` [n] times in the batch, summed per id and multiplied by `scale`, at global `step`. `lr` overrides
        the optimizer's (a schedule's value). A dynamic table counts sightings, admits ids (their first update
        applied to the initial values the lookup returned) and drops the gradients of ids still without a row.
        `checked`: as for `lookup`."""
        if not checked:
            self.check_ids(ids, "apply")
        self._check_update(ids, counts, grads)
        self.optimizer_step += 1
        ids, counts, grads = self._coalesced(ids, counts, grads, scale)
        if self._rows is None:
            rows = local_rows(self.spec, ids, self.ps_index, self.num_ps)
        else:
            rows = self._rows_seen(ids, counts, step)
            kept = (rows >= 0).nonzero()[:, 0]
            if kept.numel() < rows.numel():
                rows, grads = rows.index_select(0, kept), grads.index_select(0, kept)
        apply_update(self.optimizer, self._values, self._slots, rows, grads, step=self.optimizer_step, lr=lr)
        self._changed.index_fill_(0, rows, True)

    def maintain(self, step: int) -> None:
        """Dynamic tables: removes the rows unseen since step - expire_after_steps (checked every
        max(1, expire_after_steps // 8) steps, so a row may outlive its time by that much), then evicts the least
        frequently seen rows (the least recently seen first among equals) while there are more than
        capacity_per_ps. Called after every apply."""
        if self._rows is None:
            return
        expire_after = self.spec.expire_after_steps
        if expire_after is not None and step >= self._next_expiry_check:
            self._next_expiry_check = step + max(1, expire_after // 8)
            live = self._rows.live_rows()
            due = live[self._rows.last_seen[live] < step - expire_after]
            self._remove_rows(due)
            self._counters["expired"] += due.numel()
            self._sightings.forget_unseen_since(step - expire_after)
        capacity = self.spec.capacity_per_ps
        if capacity is not None and len(self._rows) > capacity:
            live = self._rows.live_rows()
            num_evicted = len(self._rows) - capacity + capacity // _EVICTION_SLACK
            order = least_valued(self._rows.ids[live], num_evicted, self._rows.counts[live], self._rows.last_seen[live])
            self._remove_rows(live[order])
            self._counters["evicted"] += num_evicted

    def stats(self) -> dict[str, int]:
        """Rows held now; rows admitted, ids rejected (gradients dropped for want of a row, once per id and update),
        rows evicted and expired since the table was made; its memory, and of that the rows' values (what the
        table would be as one dense tensor: `shardflow plan` reads it from a capture)."""
        rows = self._values.shape[0] if self._rows is None else len(self._rows)
        values_bytes = rows * self.spec.embedding_dim * self._values.element_size()
        return {"rows": rows, **self._counters, "memory_bytes": self.memory_bytes(), "values_bytes": values_bytes}

    def memory_bytes(self) -> int:
        """Values, slots, change marks and, for dynamic tables, the index, the per-row metadata and the sightings."""
        tensors = [self._values, self._changed, *self._slots.values()]
        held = sum(t.numel() * t.element_size() for t in tensors)
        if self._rows is not None:
            held += self._rows.memory_bytes() + self._sightings.memory_bytes()
        return held

    def rows_state(self, changed_only: bool, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """This PS's rows as plain tensors (a copy): "ids" (global), "values", "slot.<name>" per optimizer slot, and
        for dynamic tables "counts" and "last_seen", sorted by id, and the ids waiting for admission ("pending.*").
        With `changed_only`, only the rows changed since `mark_saved`, and "removed": the ids that had a row then
        (or got one since) and have none now. `copy=False`: a fixed table's whole values and slots are the table's
        own, for a caller that is done with them before the next update (a PS writing its checkpoint files)."""
        if self._rows is None and not changed_only:
            rows = torch.arange(self._values.shape[0])
            held = [self._values, *self._slots.values()]
            values, *slots = held if not copy else [tensor.clone() for tensor in held]
            state = {"ids": global_ids(self.spec, rows, self.ps_index, self.num_ps), "values": values}
            return state | {f"slot.{name}": slot for name, slot in zip(self._slots, slots, strict=True)}
        if self._rows is None:
            rows = self._changed.nonzero()[:, 0]
            state = {"ids": global_ids(self.spec, rows, self.ps_index, self.num_ps)}
        else:
            rows = self._rows.live_rows()
            if changed_only:
                rows = rows[self._changed[rows]]
            rows = rows[torch.argsort(self._rows.ids[rows])]
            state = {
                "ids": self._rows.ids[rows],
                "counts": self._rows.counts[rows],
                "last_seen": self._rows.last_seen[rows],
            }
        state["values"] = self._values[rows]
        state |= {f"slot.{name}": slot[rows] for name, slot in self._slots.items()}
        if changed_only:
            state["removed"] = self._removed_ids()
        if self._rows is not None:
            state |= self._sightings.state(torch.tensor([self.ps_index, self.num_ps]))
        return state

    def scalars(self) -> dict[str, float]:
        """The table-level optimizer step and, for dynamic tables, the step of the next expiry check."""
        scalars = {"optimizer_step": float(self.optimizer_step)}
        if self._rows is not None:
            scalars["next_expiry_check"] = float(self._next_expiry_check)
        return scalars

    def load_scalars(self, scalars: dict[str, float]) -> None:
        if "optimizer_step" not in scalars:
            raise ValueError(f"table {self.spec.name!r}: the checkpoint's scalars have no 'optimizer_step'")
        self.optimizer_step = int(scalars["optimizer_step"])
        if self._rows is not None:
            self._next_expiry_check = int(scalars.get("next_expiry_check", 0))

    def mark_saved(self) -> None:
        """Everything held now is saved: no row is changed and none removed."""
        self._changed.zero_()
        if self._rows is not None:
            self._removed = []

    def load_rows(self, state: dict[str, torch.Tensor]) -> None:
        """Writes the rows of `state` (as `rows_state` makes them, from any number of PS) that this PS owns over its
        own, making those it lacks, and removes the "removed" ids it owns. Loaded rows count as changed: call
        `mark_saved` after restoring from the checkpoint that is the base of the next increment."""
        ids = _checked_state(self.spec, self._layouts, state)
        size = self.spec.num_embeddings
        if size is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= size):
            bad = int(ids[(ids < 0) | (ids >= size)][0])
            raise ValueError(f"table {self.spec.name!r} has ids 0 to {size - 1}; the checkpoint has a row of id {bad}")
        mine = self._owned(ids)
        removed = state.get("removed")
        if removed is not None and self._rows is not None:
            rows = self._rows.find(torch.unique(removed[self._owned(removed)]))
            self._remove_rows(rows[rows >= 0])
        ids = ids[mine]
        if self._rows is None:
            rows = local_rows(self.spec, ids, self.ps_index, self.num_ps)
        else:
            rows = self._rows.find(ids)
            absent = rows < 0
            rows[absent] = self._new_rows(ids[absent])
            self._rows.counts[rows] = state["counts"][mine]
            self._rows.last_seen[rows] = state["last_seen"][mine]
        self._values[rows] = state["values"][mine]
        for name, slot in self._slots.items():
            slot[rows] = state[f"slot.{name}"][mine]
        self._changed[rows] = True
        if self._rows is not None and PENDING_SOURCE in state:
            self._sightings.load(state, self._owned)

    def _lookup_dynamic(self, ids: torch.Tensor) -> torch.Tensor:
        assert self._rows is not None
        rows = self._rows.find(ids)
        absent = (rows < 0).nonzero()[:, 0]
        if not absent.numel():
            self._renormalise(rows)
            return self._values.index_select(0, rows)
        out = torch.empty((ids.numel(), self.spec.embedding_dim), dtype=torch.float32)
        present = (rows >= 0).nonzero()[:, 0]
        held = rows.index_select(0, present)
        self._renormalise(held)
        out.index_copy_(0, present, self._values.index_select(0, held))
        made = initial_rows(self.spec, ids.index_select(0, absent))
        if self.spec.max_norm is not None:
            _clip_norms(self.spec, made)
        return out.index_copy_(0, absent, made)

    def _initialise_fixed_rows(self) -> None:
        for begin in range(0, self._values.shape[0], _INIT_CHUNK_ROWS):
            rows = torch.arange(begin, min(begin + _INIT_CHUNK_ROWS, self._values.shape[0]))
            self._values[begin : begin + rows.numel()] = initial_rows(
                self.spec, global_ids(self.spec, rows, self.ps_index, self.num_ps)
            )
        padding = self._padding_id
        if padding is not None and self._owned(torch.tensor([padding]))[0]:
            self._values[local_rows(self.spec, torch.tensor([padding]), self.ps_index, self.num_ps)] = 0.0

    def _owned(self, ids: torch.Tensor) -> torch.Tensor:
        mine = owners(self.spec, ids, self.num_ps) == self.ps_index
        if self.spec.num_embeddings is not None:
            mine &= (ids >= 0) & (ids < self.spec.num_embeddings)
        return mine

    def _check_update(self, ids: torch.Tensor, counts: torch.Tensor, grads: torch.Tensor) -> None:
        n, dim = ids.numel(), self.spec.embedding_dim
        if counts.dtype != torch.int64 or tuple(counts.shape) != (n,):
            raise ValueError(
                f"apply: table {self.spec.name!r} takes counts as int64 [{n}], got {counts.dtype} {tuple(counts.shape)}"
            )
        if grads.dtype != torch.float32 or tuple(grads.shape) != (n, dim):
            raise ValueError(
                f"apply: table {self.spec.name!r} takes gradients as float32 [{n}, {dim}], got {grads.dtype} "
                f"{tuple(grads.shape)}"
            )

    def _coalesced(
        self, ids: torch.Tensor, counts: torch.Tensor, grads: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One entry per id, gradients and counts summed, the padding id's dropped; gradients times `scale`."""
        if self._padding_id is not None:
            kept = ids != self._padding_id
            ids, counts, grads = ids[kept], counts[kept], grads[kept]
        if ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all()):
            # Distinct already, as a worker pushes them (its batch's unique ids, sorted): nothing to sum.
            return ids, counts, grads * scale if scale != 1.0 else grads
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros((unique.numel(), grads.shape[1]), dtype=grads.dtype).index_add_(0, inverse, grads)
        summed_counts = torch.zeros_like(unique).index_add_(0, inverse, counts)
        if scale != 1.0:
            summed.mul_(scale)
        return unique, summed_counts, summed

    def _rows_seen(self, ids: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        """Dynamic tables: counts the sightings of distinct `ids` and admits those due; the row of each id, -1 for
        those still without one (rejected)."""
        assert self._rows is not None
        rows = self._rows.find(ids)
        absent = (rows < 0).nonzero()[:, 0]
        held, seen = rows, counts
        if absent.numel():
            present = (rows >= 0).nonzero()[:, 0]
            held, seen = rows.index_select(0, present), counts.index_select(0, present)
        self._rows.counts.index_add_(0, held, seen)
        self._rows.last_seen.index_fill_(0, held, step)
        if absent.numel():
            admitted, sightings = self._sightings.admit(ids[absent], counts[absent], step)
            new = absent[admitted]
            rows[new] = self._new_rows(ids[new])
            self._rows.counts[rows[new]] = sightings[admitted]
            self._rows.last_seen[rows[new]] = step
            self._counters["admitted"] += new.numel()
            self._counters["rejected"] += absent.numel() - new.numel()
        return rows

    def _new_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ids that have none, at their initial values as a lookup read them (renormalised with max_norm),
        with fresh slots; counts and last_seen are the caller's to set."""
        assert self._rows is not None
        rows = self._rows.add(ids)
        if self._rows.capacity > self._values.shape[0]:
            self._grow_storage(self._rows.capacity)
        values = initial_rows(self.spec, ids)
        if self.spec.max_norm is not None:
            _clip_norms(self.spec, values)
        self._values[rows] = values
        for name, slot in new_slots(self._layouts, rows.numel()).items():
            self._slots[name][rows] = slot
        self._changed[rows] = True
        return rows

    def _grow_storage(self, capacity: int) -> None:
        def grown(tensor: torch.Tensor) -> torch.Tensor:
            bigger = tensor.new_zeros((capacity, *tensor.shape[1:]))
            bigger[: tensor.shape[0]] = tensor
            return bigger

        self._values = grown(self._values)
        self._slots = {name: grown(slot) for name, slot in self._slots.items()}
        self._changed = grown(self._changed)

    def _remove_rows(self, rows: torch.Tensor) -> None:
        assert self._rows is not None
        if rows.numel():
            self._removed.append(self._rows.remove(rows))
            self._changed[rows] = False

    def _removed_ids(self) -> torch.Tensor:
        if self._rows is None or not self._removed:
            return torch.empty(0, dtype=torch.int64)
        removed: torch.Tensor = torch.unique(torch.cat(self._removed))
        return removed[self._rows.find(removed) < 0]

    def _renormalise(self, rows: torch.Tensor) -> None:
        """torch.embedding_renorm_ on the stored rows: those of norm above max_norm are scaled to it (and changed)."""
        if self.spec.max_norm is None or not rows.numel():
            return
        rows = torch.unique(rows)
        values = self._values[rows]
        over = _clip_norms(self.spec, values)
        self._values[rows[over]] = values[over]
        self._changed[rows[over]] = True


def _clip_norms(spec: TableSpec, values: torch.Tensor) -> torch.Tensor:
    """Scales, in place, the rows of `values` with a norm above max_norm to it, as torch.embedding_renorm_ (scale
    max_norm / (norm + 1e-7)); which rows were."""
    assert spec.max_norm is not None
    norms = torch.linalg.vector_norm(values, ord=spec.norm_type, dim=1)
    over: torch.Tensor = norms > spec.max_norm
    if bool(over.any()):
        scale = (spec.max_norm / (norms[over].to(torch.float64) + 1e-7)).to(torch.float32)
        values[over] *= scale.unsqueeze(1)
    return over


def _padding_id(spec: TableSpec) -> int | None:
    """The padding id, a negative one of a fixed table counted from its end as torch.nn.Embedding does."""
    padding = spec.padding_idx
    if padding is not None and padding < 0 and spec.num_embeddings is not None:
        return padding + spec.num_embeddings
    return padding


def _checked_state(spec: TableSpec, layouts: dict[str, SlotLayout], state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ids of a checkpoint's rows of `spec`'s table, once every tensor is there with its dtype and shape."""
    ids = state.get("ids")
    if ids is None or ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"table {spec.name!r}: the checkpoint's rows need 'ids', a 1-D int64 tensor")
    n = ids.numel()
    if torch.unique(ids).numel() != n:
        raise ValueError(f"table {spec.name!r}: the checkpoint's 'ids' repeat ids; each row must appear once")
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {"values": (torch.float32, (n, spec.embedding_dim))}
    expected |= {f"slot.{name}": (layout.dtype, (n, *layout.row_shape)) for name, layout in layouts.items()}
    if spec.dynamic:
        expected |= {"counts": (torch.int64, (n,)), "last_seen": (torch.int64, (n,))}
    removed = state.get("removed")
    if removed is not None:
        expected["removed"] = (torch.int64, (removed.numel(),))
    for key, (dtype, shape) in expected.items():
        tensor = state.get(key)
        if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            got = "nothing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(f"table {spec.name!r}: the checkpoint's {key!r} should be {dtype} {shape}, got {got}")
    return ids
