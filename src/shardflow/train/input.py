"""A worker's place in its input: the epoch, the batches consumed in it, and the pipeline's own state.

When a job restores a checkpoint written by a different number of workers, the old shards cannot be mapped onto the
new ones. Each new worker first finishes some of the old shards where they stopped (`carry_over` says which), all of
them through the same epoch, and only then starts its own shard at the next epoch. So `epochs=k` still means every
record is seen exactly k times across the cluster, whatever the worker counts before and after.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from shardflow.train.input_sharding import WorkerInput
from shardflow.train.job import UserCodeError
from shardflow.train.specs import InputContext, TrainSpec

log = logging.getLogger(__name__)


class EmptyInputError(UserCodeError, ValueError):
    """A worker's input yielded nothing in its first epoch, and the TrainSpec does not allow that: the same on a
    restart, so the worker is not restarted for it."""


class _Shard:
    """One input_fn(ctx) pipeline, iterated epoch after epoch through `last_epoch` (inclusive). An epoch that yields
    nothing ends it: in epoch 0 that fails unless the spec allows empty input; later, input_fn has nothing left."""

    def __init__(
        self,
        spec: TrainSpec,
        ctx: InputContext,
        state: dict[str, Any] | None,
        last_epoch: float,
        announce: bool = False,
    ) -> None:
        self.spec = spec
        self.ctx = ctx
        self.last_epoch = last_epoch
        self.epoch = int(state["epoch"]) if state else 0
        self.consumed = 0
        self._input: WorkerInput | None = None
        self._announce = announce
        """Say how the input is sharded once its first batch was read (a generator reads ctx only then)."""
        self._iterator: Iterator[Any] = iter(())
        self._stateful = False
        if self.epoch <= last_epoch:
            self._start(state)

    def _start(self, state: dict[str, Any] | None) -> None:
        self._input = WorkerInput(self.spec.input_fn, dataclasses.replace(self.ctx, epoch=self.epoch))
        iterator = iter(self._input.iterable)
        self._stateful = callable(getattr(iterator, "get_state", None)) and callable(
            getattr(iterator, "set_state", None)
        )
        self.consumed = 0
        if state:
            self.consumed = int(state["consumed"])
            if self._stateful and state.get("inner") is not None:
                try:
                    iterator.set_state(state["inner"])  # type: ignore[attr-defined]
                except (KeyError, TypeError, ValueError, IndexError) as error:
                    raise ValueError(
                        f"the input position saved in the checkpoint does not fit this input pipeline "
                        f"({type(error).__name__}: {error}); was input_fn changed since? Train from a fresh "
                        "model_dir, or restore with the pipeline that wrote the checkpoint"
                    ) from error
            else:
                for _ in itertools.islice(iterator, self.consumed):
                    pass
        self._iterator = iterator

    def next(self) -> Any:
        """The next batch, moving on to the next epoch when one ends; _END after `last_epoch`."""
        while self.epoch <= self.last_epoch:
            batch = next(self._iterator, _END)
            if batch is not _END:
                self.consumed += 1
                if self._announce and self._input is not None:
                    self._announce = False
                    self._input.announce()
                return batch
            if self.consumed == 0:
                self._end_empty()
                return _END
            self.epoch += 1
            if self.epoch <= self.last_epoch:
                self._start(None)
        return _END

    def _end_empty(self) -> None:
        """This epoch yielded nothing: fail in epoch 0 unless allowed; else the input ends here (with max_steps
        alone, input_fn would be called for ever)."""
        assert self._input is not None  # an epoch was started
        name = self._input.name
        if self.epoch == 0 and not self.spec.allow_empty_input:
            raise EmptyInputError(_empty_message(self.spec, self.ctx, self._input.describe()))
        if self.epoch == 0:
            log.warning("%s has no input (TrainSpec.allow_empty_input=True): it trains no step", name)
        else:
            log.warning(
                "%s: epoch %d of its input yielded no batch, so its input ends here. input_fn is called once per "
                "epoch: does it return an iterator that the epoch before used up?",
                name,
                self.epoch,
            )
        self.last_epoch = self.epoch - 1

    def get_state(self) -> dict[str, Any]:
        inner = self._iterator.get_state() if self._stateful else None  # type: ignore[attr-defined]
        return {"epoch": self.epoch, "consumed": self.consumed, "inner": inner}


def _empty_message(spec: TrainSpec, ctx: InputContext, sharding: str) -> str:
    """Why a worker's first epoch is empty, as far as one look at the whole input tells: the whole input is empty
    (a glob that matches no file), or only this worker's share is (fewer files or records than workers)."""
    likely = "a glob that matches no file, an empty file, or a filter that keeps nothing?"
    if ctx.num_workers > 1 and _whole_input_yields(spec):
        likely = (
            "the whole input is not empty, but this worker's share is: fewer files or records than the "
            f"{ctx.num_workers} workers?"
        )
    return (
        f"worker:{ctx.worker_index} read no batch in its first epoch: input_fn(InputContext(num_workers="
        f"{ctx.num_workers}, worker_index={ctx.worker_index}, epoch=0)){sharding} yielded nothing. Likely "
        f"{likely} Fix the input, or pass TrainSpec(allow_empty_input=True) if some workers may have nothing to read"
    )


def _whole_input_yields(spec: TrainSpec) -> bool:
    """Whether input_fn yields a batch for a single worker (which reads everything); False where it cannot tell."""
    try:
        iterator = iter(spec.input_fn(InputContext(1, 0, 0)))
        found = next(iterator, _END) is not _END
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
        return found
    except Exception:  # a look for the message only: the error to raise is the empty input
        return False


class InputPosition:
    """Iterates `spec.input_fn(ctx)` epoch after epoch and can say, and resume, exactly where it is.

    A pipeline whose iterator has get_state/set_state (shardflow.data) resumes from its state; any other
    iterable is re-created and fast-forwarded past the batches already consumed in the epoch. A state with
    "carry" entries (from `carry_over`) first finishes those old shards."""

    def __init__(self, spec: TrainSpec, ctx: InputContext, state: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.ctx = ctx
        self._last_epoch = math.inf if spec.epochs is None else spec.epochs - 1
        state = state or {}
        self._carry: list[dict[str, Any]] = [dict(entry) for entry in state.get("carry", [])]
        own: dict[str, Any] = {key: state[key] for key in ("epoch", "consumed", "inner") if key in state}
        self._own_state: dict[str, Any] | None = own or None
        self._own: _Shard | None = None
        self._shard: _Shard | None = self._next_shard()

    @property
    def epoch(self) -> int:
        """The epoch of the batches being read now."""
        shard = self._shard or self._own
        assert shard is not None  # the own shard exists once no other is being read
        return shard.epoch

    def _next_shard(self) -> _Shard | None:
        if self._carry:
            entry = self._carry.pop(0)
            ctx = InputContext(int(entry["num_workers"]), int(entry["index"]))
            return _Shard(self.spec, ctx, entry["position"], min(float(entry["last_epoch"]), self._last_epoch))
        if self._own is None:
            self._own = _Shard(self.spec, self.ctx, self._own_state, self._last_epoch, announce=True)
            return self._own
        return None

    def next(self) -> Any | None:
        """The next batch; None when all epochs are done."""
        while self._shard is not None:
            batch = self._shard.next()
            if batch is not _END:
                return batch
            if self._shard is self._own:
                return None
            self._shard = self._next_shard()
        return None

    def get_state(self) -> dict[str, Any]:
        if self._shard is None or self._shard is self._own:
            assert self._own is not None  # the own shard exists once no other is being read
            return self._own.get_state()
        carried = self._shard
        carry = [
            {
                "num_workers": carried.ctx.num_workers,
                "index": carried.ctx.worker_index,
                "position": carried.get_state(),
                "last_epoch": int(carried.last_epoch),
            },
            *self._carry,
        ]
        return {**(self._own_state or {"epoch": 0, "consumed": 0, "inner": None}), "carry": carry}


def carry_over(positions: dict[str, dict[str, Any]], old_workers: int, new_workers: int) -> dict[str, dict[str, Any]]:
    """New workers' starting positions from the positions of a different number of old workers.

    The old shards are dealt round-robin to the new workers, which finish each from where it stopped through epoch
    F, the furthest epoch any old worker had reached; then every new worker starts its own shard at epoch F + 1.
    Shards an old worker was itself still finishing (after an earlier change) are handed on as they are, first."""
    if not positions:
        return {}
    own = {i: positions.get(f"worker:{i}", {"epoch": 0, "consumed": 0, "inner": None}) for i in range(old_workers)}
    furthest = max(int(position["epoch"]) for position in own.values())
    pieces: list[dict[str, Any]] = [entry for position in own.values() for entry in position.get("carry", [])]
    for i, position in own.items():
        state = {key: position[key] for key in ("epoch", "consumed", "inner")}
        pieces.append({"num_workers": old_workers, "index": i, "position": state, "last_epoch": furthest})
    new: dict[str, dict[str, Any]] = {
        f"worker:{j}": {"epoch": furthest + 1, "consumed": 0, "inner": None, "carry": []} for j in range(new_workers)
    }
    for n, piece in enumerate(pieces):
        new[f"worker:{n % new_workers}"]["carry"].append(piece)
    return new


_END = object()


class Lookahead:
    """An input position that can read batches ahead (so the rows a later step looks up are fetched while this one
    computes) and still says where the batches handed out so far end. Hands out each batch through `convert`."""

    def __init__(self, position: InputPosition, convert: Callable[[Any], Any]) -> None:
        self.position, self.convert = position, convert
        self._peeked: list[tuple[Any, dict[str, Any], int]] = []
        """The batches read ahead, in order, each with the position and epoch from before it was read."""
        self._ended = False

    @property
    def epoch(self) -> int:
        return self._peeked[0][2] if self._peeked else self.position.epoch

    def next(self) -> Any | None:
        if self._peeked:
            return self._peeked.pop(0)[0]
        batch = None if self._ended else self.position.next()
        self._ended = batch is None
        return None if batch is None else self.convert(batch)

    def peek(self, ahead: int = 1) -> Any | None:
        """The batch `next` hands out `ahead` calls from now (1: the next one), read now; None past the input's
        end."""
        while len(self._peeked) < ahead:
            if self._ended:
                return None
            before, epoch = self.position.get_state(), self.position.epoch
            batch = self.position.next()
            if batch is None:
                self._ended = True
                return None
            self._peeked.append((self.convert(batch), before, epoch))
        return self._peeked[ahead - 1][0]

    def get_state(self) -> dict[str, Any]:
        return self._peeked[0][1] if self._peeked else self.position.get_state()
