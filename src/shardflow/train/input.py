"""A worker's place in its input: the epoch, the batches consumed in it, and the pipeline's own state."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from shardflow.train.specs import InputContext, TrainSpec


class InputPosition:
    """Iterates `spec.input_fn(ctx)` epoch after epoch and can say, and resume, exactly where it is.

    A pipeline whose iterator has get_state/set_state (shardflow.data) resumes from its state; any other
    iterable is re-created and fast-forwarded past the batches already consumed in the epoch."""

    def __init__(self, spec: TrainSpec, ctx: InputContext, state: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.ctx = ctx
        self.epoch = int(state["epoch"]) if state else 0
        self.consumed = 0
        self._iterator: Iterator[Any] = iter(())
        self._stateful = False
        if self._epochs_left():
            self._start(state)

    def _epochs_left(self) -> bool:
        return self.spec.epochs is None or self.epoch < self.spec.epochs

    def _start(self, state: dict[str, Any] | None) -> None:
        iterator = iter(self.spec.input_fn(self.ctx))
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

    def next(self) -> Any | None:
        """The next batch, moving on to the next epoch when one ends; None when all epochs are done."""
        while self._epochs_left():
            batch = next(self._iterator, _END)
            if batch is not _END:
                self.consumed += 1
                return batch
            self.epoch += 1
            if self._epochs_left():
                self._start(None)
        return None

    def get_state(self) -> dict[str, Any]:
        inner = self._iterator.get_state() if self._stateful else None  # type: ignore[attr-defined]
        return {"epoch": self.epoch, "consumed": self.consumed, "inner": inner}


_END = object()
