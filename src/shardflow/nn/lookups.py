"""The worker's side of `sf.nn` tables: the rows a batch looks up, gathered from their PS in one `Lookup` per PS
for all tables (sent for the next batch while the current one computes, once the worker knows which of the
batch's tensors each table reads), and the gradients of those rows, pushed with the step."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardflow.nn.backend import Looked
from shardflow.nn.modules import TableModule, tables
from shardflow.ps import protocol
from shardflow.ps.connection import PSConnection
from shardflow.ps.embeddings.spec import owners
from shardflow.ps.protocol import StepReply

log = logging.getLogger(__name__)

Path = tuple[Any, ...]
"""Where a tensor sits in a batch: the keys and indices leading to it."""


@dataclass
class _Ids:
    """One table's ids of one lookup, prepared: unique, where each id is among them, how often each occurs, and
    which of the unique ids each PS owns."""

    table: int
    source: torch.Tensor
    unique: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    mine: list[torch.Tensor | None]
    """Per PS: the positions in `unique` of the ids it owns; None: all of them (it is the only PS)."""
    rows: torch.Tensor | None = None


@dataclass
class _Round:
    """The lookups of one batch, one `Lookup` per PS for every table: sent, and collected on first need."""

    wanted: list[_Ids]
    seqs: dict[int, int] = field(default_factory=dict)
    sent: dict[int, list[tuple[int, torch.Tensor | None]]] = field(default_factory=dict)
    """Per PS: for each id list sent, its index in `wanted` and which of its unique ids went."""
    collected: bool = False
    riding: dict[int, list[torch.Tensor] | None] | None = None
    """A round that rode on the pushes of a step (`TableLookups.ride`): per PS, the rows its push's reply brought
    (None until it came); None for a round of `Lookup`s of its own."""


@dataclass
class _Riding:
    """The lookups of a batch prepared to ride on a step's pushes: its round, the keys of its id lists and per PS
    the table indices and ids its push carries."""

    batch: Any
    round: _Round
    keys: list[tuple[int, int]]
    parts: dict[int, tuple[list[int], list[torch.Tensor]]]


class TableLookups:
    """Looks up the rows of a model's `sf.nn` tables for each step of one worker and gathers their gradients."""

    def __init__(self, connection: PSConnection, model: torch.nn.Module, *, prefetch: bool = True) -> None:
        self.connection = connection
        self.modules = tables(model)
        self.specs = [module.spec() for module in self.modules.values()]
        self._index = {name: i for i, name in enumerate(self.modules)}
        self.num_ps = len(connection.peers)
        self.prefetch_enabled = prefetch
        self.paths: dict[tuple[int, int], Path | None] = {}
        """Per (table, call within a batch): where in the batch its ids are; None: not in the batch (derived)."""
        self.not_prefetched = 0
        """Lookups made when the forward asked, not ahead."""
        self._batch: Any = None
        self._calls: dict[int, int] = {}
        self._ahead: dict[tuple[int, int], tuple[_Round, _Ids]] = {}
        self._next: dict[tuple[int, int], tuple[_Round, _Ids]] = {}
        self._later: list[tuple[Any, dict[tuple[int, int], tuple[_Round, _Ids]]]] = []
        """The lookups sent ahead for the rest of this step's batches (gradient accumulation), in their order."""
        self._looked: list[tuple[_Ids, torch.Tensor]] = []
        self._riding: _Riding | None = None
        """The lookups of a batch prepared to ride on this step's pushes (`ride`)."""
        self._rode: tuple[Any, dict[tuple[int, int], tuple[_Round, _Ids]]] | None = None
        """The lookups that rode on the last step's pushes, with their batch, until the next `prefetch` takes them."""
        self._by_push: dict[tuple[int, int], _Round] = {}
        """The rounds whose rows the reply to a push brings, by (PS, sequence number of the push)."""

    def __len__(self) -> int:
        return len(self.specs)

    # -- a step ------------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step: the rows looked up before are forgotten; the lookups sent ahead for its batch are ready."""
        self._looked = []
        self._ahead, self._next, self._later = self._next, {}, []

    def set_batch(self, batch: Any) -> None:
        """The batch the model is about to be run on (each of a step's batches, with accumulation): the lookups
        `prefetch_later` sent for it are ready."""
        self._batch = batch
        self._calls = {}
        if self._later and self._later[0][0] is batch:
            self._ahead = self._later.pop(0)[1]

    def prefetch(self, batch: Any, min_step: Sequence[int]) -> None:
        """Send the lookups of `batch`, the next step's, for every table whose ids are known to sit in the batch;
        ps:k answers once its step is at least `min_step[k]`. None are sent when they rode on an earlier push."""
        rode, self._rode = self._rode, None
        if rode is not None and rode[0] is batch:
            self._next = rode[1]
        elif self.prefetch_enabled:
            self._next = self._sent_ahead(batch, min_step)

    def ride(self, batch: Any) -> None:
        """Prepare the lookups of `batch`, the step's after next, to ride on this step's pushes (`riding`): in
        overlapped async training the push to a PS goes right before the lookup would, and its reply comes before
        the batch's step begins. The rows are those after this push, as a `Lookup` sent next would read them."""
        self._riding = None
        if not self.prefetch_enabled:
            return
        wanted, keys = self._wanted(batch)
        if wanted:
            lookup_round = _Round(wanted, riding={})
            self._riding = _Riding(batch, lookup_round, keys, self._split(lookup_round))

    def riding(self, ps: int) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """The table indices and the ids of the lookup riding on this step's push to `ps` (none without one)."""
        parts = self._riding.parts.get(ps) if self._riding is not None else None
        return (tuple(parts[0]), parts[1]) if parts is not None else ((), [])

    def rode(self, seqs: dict[int, int]) -> None:
        """This step's pushes went out, as sequence number `seqs[ps]` to each PS; empty: they did not (a step that
        held NaN or inf sends `NonFinite` instead), and the riding lookups go as `Lookup`s of their own."""
        riding, self._riding = self._riding, None
        if riding is None:
            return
        lookup_round = riding.round
        if seqs:
            for ps in riding.parts:
                lookup_round.seqs[ps] = seqs[ps]
                self._by_push[ps, seqs[ps]] = lookup_round
        else:
            lookup_round = self._send(lookup_round.wanted, [0] * self.num_ps)
        looked = {key: (lookup_round, ids) for key, ids in zip(riding.keys, lookup_round.wanted, strict=True)}
        self._rode = riding.batch, looked

    def push_replied(self, ps: int, seq: int, rows: list[torch.Tensor]) -> None:
        """The rows the reply to push `seq` to `ps` brought, of the lookup that rode on it."""
        lookup_round = self._by_push.pop((ps, seq), None)
        if lookup_round is not None and lookup_round.riding is not None:
            lookup_round.riding[ps] = rows

    def prefetch_later(self, batches: Sequence[Any], min_step: Sequence[int]) -> None:
        """Send the lookups of the rest of this step's batches now (gradient accumulation reads them all before the
        first one's forward), a round each; ps:k answers once its step is at least `min_step[k]`."""
        if self.prefetch_enabled:
            self._later = [(batch, self._sent_ahead(batch, min_step)) for batch in batches]

    def _sent_ahead(self, batch: Any, min_step: Sequence[int]) -> dict[tuple[int, int], tuple[_Round, _Ids]]:
        """The lookups of `batch` sent, in one round, for every table whose ids are known to sit in a batch."""
        wanted, keys = self._wanted(batch)
        if not wanted:
            return {}
        lookup_round = self._send(wanted, min_step)
        return {key: (lookup_round, ids) for key, ids in zip(keys, wanted, strict=True)}

    def _wanted(self, batch: Any) -> tuple[list[_Ids], list[tuple[int, int]]]:
        """The id lists of `batch` prepared, for every table whose ids are known to sit in a batch, and their keys."""
        wanted: list[_Ids] = []
        keys: list[tuple[int, int]] = []
        for key, path in self.paths.items():
            ids = _at(batch, path) if path is not None else None
            if isinstance(ids, torch.Tensor):
                wanted.append(self._prepare(key[0], ids))
                keys.append(key)
        return wanted, keys

    def lookup(self, module: TableModule, ids: torch.Tensor) -> Looked:
        """The rows of `ids` for `module`'s forward: those sent ahead if they are of these ids, else fetched now."""
        table = self._index[module.table_name or ""]
        call = self._calls.get(table, 0)
        self._calls[table] = call + 1
        key = (table, call)
        if key not in self.paths:
            self.paths[key] = self._find(ids)
            if self.paths[key] is None:
                log.info(
                    "sf.nn table %r reads ids that are not a tensor of the batch (computed in forward?): its rows are "
                    "fetched when forward asks, not ahead; pass the batch's tensor itself to prefetch them",
                    module.table_name,
                )
        ahead = self._ahead.pop(key, None)
        if ahead is not None and _same(ahead[1].source, ids):
            lookup_round, prepared = ahead
        else:
            self.not_prefetched += 1
            prepared = self._prepare(table, ids)
            lookup_round = self._send([prepared], [0] * self.num_ps)
        self._collect(lookup_round)
        assert prepared.rows is not None
        rows = prepared.rows.to(ids.device)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._looked.append((prepared, rows))
        return Looked(rows, prepared.inverse.to(ids.device).view(ids.shape), prepared.unique)

    def grad_frames(self, ps: int) -> list[torch.Tensor]:
        """For each table, the unique ids of this step's lookups that `ps` owns, how often each occurred, and their
        gradient rows (zeros where backward left none): three frames per table, maybe empty."""
        frames: list[torch.Tensor] = []
        for table, spec in enumerate(self.specs):
            ids, counts, grads = [], [], []
            for prepared, rows in self._looked:
                if prepared.table != table:
                    continue
                mine = prepared.mine[ps]
                grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
                if mine is None:
                    ids.append(prepared.unique)
                    counts.append(prepared.counts)
                    grads.append(grad)
                else:
                    ids.append(prepared.unique[mine])
                    counts.append(prepared.counts[mine])
                    grads.append(grad.index_select(0, mine.to(grad.device)))
            if not ids:
                dim = spec.embedding_dim
                frames += [_EMPTY_IDS, _EMPTY_IDS, torch.empty((0, dim), dtype=spec.torch_dtype)]
            elif len(ids) == 1:  # one lookup of the table this step, the usual case: nothing to join
                frames += [ids[0], counts[0], grads[0]]
            else:
                frames += [torch.cat(ids), torch.cat(counts), torch.cat(grads)]
        return frames

    def gradients(self) -> list[torch.Tensor]:
        """This step's gradients of looked-up rows, for clipping on the worker."""
        return [rows.grad for _, rows in self._looked if rows.grad is not None]

    # -- the requests ---------------------------------------------------------------------------------

    def _prepare(self, table: int, ids: torch.Tensor) -> _Ids:
        flat = ids.detach().reshape(-1).to("cpu", torch.int64)
        unique, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        spec = self.specs[table]
        if spec.num_embeddings is not None and unique.numel():
            low, high = int(unique[0]), int(unique[-1])
            if low < 0 or high >= spec.num_embeddings:
                raise IndexError(
                    f"sf.nn table {spec.name!r} has {spec.num_embeddings} rows; the batch looks up ids {low}..{high}"
                )
        if self.num_ps == 1:
            mine: list[torch.Tensor | None] = [None]
        else:
            owner = owners(spec, unique, self.num_ps)
            mine = [(owner == ps).nonzero().view(-1) for ps in range(self.num_ps)]
        return _Ids(table, ids, unique, inverse, counts, mine)

    def _send(self, wanted: list[_Ids], min_step: Sequence[int]) -> _Round:
        lookup_round = _Round(wanted)
        connection = self.connection
        for ps, (indices, frames) in self._split(lookup_round).items():
            lookup = protocol.Lookup(table_indices=tuple(indices), min_step=min_step[ps])
            lookup_round.seqs[ps] = connection.client.send(connection.peers[ps], lookup.header(), frames)
        return lookup_round

    def _split(self, lookup_round: _Round) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
        """Per PS that owns any of the round's ids: the table indices and the ids it is asked for (noted in
        `sent`)."""
        split = {}
        for ps in range(self.num_ps):
            indices, frames, sent = [], [], []
            for position, prepared in enumerate(lookup_round.wanted):
                mine = prepared.mine[ps]
                ids = prepared.unique if mine is None else prepared.unique[mine]
                if ids.numel():
                    indices.append(prepared.table)
                    frames.append(ids)
                    sent.append((position, mine))
            if indices:
                lookup_round.sent[ps] = sent
                split[ps] = indices, frames
        return split

    def _collect(self, lookup_round: _Round) -> None:
        """Receive every PS's rows of a round and put them in place, once."""
        if lookup_round.collected:
            return
        for prepared in lookup_round.wanted:
            dim = self.specs[prepared.table].embedding_dim
            prepared.rows = torch.empty((prepared.unique.numel(), dim), dtype=self.specs[prepared.table].torch_dtype)
        connection = self.connection
        for ps, seq in lookup_round.seqs.items():
            peer = connection.peers[ps]
            if lookup_round.riding is not None:
                values = lookup_round.riding.get(ps)
                if values is None:  # the worker waits for every push's reply before the step after next
                    raise protocol.PSProtocolError("push", "rows", peer, "did not come with the push's reply")
            else:
                header, values = connection.recv(peer, seq)
                StepReply.decode(header, protocol.Lookup.op, peer)
            sent = lookup_round.sent[ps]
            if len(values) != len(sent):
                raise protocol.PSProtocolError(
                    protocol.Lookup.op, "frames", peer, f"{len(values)} came for {len(sent)} tables asked"
                )
            for (position, mine), rows in zip(sent, values, strict=True):
                prepared = lookup_round.wanted[position]
                if mine is None:  # the only PS: its frame holds every row, in order (read only, as autograd reads it)
                    prepared.rows = rows
                    continue
                assert prepared.rows is not None
                prepared.rows.index_copy_(0, mine, rows)
        lookup_round.collected = True

    def _find(self, ids: torch.Tensor) -> Path | None:
        if self._batch is None or not ids.numel():
            return None
        for path, tensor in _leaves(self._batch, ()):
            if _same(tensor, ids):
                return path
        return None


_EMPTY_IDS = torch.empty(0, dtype=torch.int64)


def _same(tensor: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether `ids` are the elements of `tensor` (the tensor itself, or a view of all of it)."""
    return (
        tensor.numel() == ids.numel()
        and tensor.numel() > 0
        and tensor.data_ptr() == ids.data_ptr()
        and tensor.dtype == ids.dtype
        and tensor.device == ids.device
    )


def _leaves(batch: Any, path: Path) -> Iterator[tuple[Path, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(batch, (tuple, list)):
        for index, value in enumerate(batch):
            yield from _leaves(value, (*path, index))


def _at(batch: Any, path: Path) -> Any:
    for key in path:
        try:
            batch = batch[key]
        except (KeyError, IndexError, TypeError):
            return None
    return batch
