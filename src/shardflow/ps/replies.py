"""The headers a PS replies with, typed and checked on receipt; see ps/protocol.py for which request gets which."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from shardflow.ps.fields import (
    Invalid,
    PSProtocolError,
    bool_field,
    check_keys,
    int_field,
    ints_field,
    map_field,
    per_part,
    short,
)


@dataclass(frozen=True, kw_only=True)
class StepReply:
    """The global step after a request, and whether training is over; what every reply carries."""

    step: int
    stop: bool
    dropped: bool = False
    """A push that arrived after training ended, not applied."""
    stale: bool = False
    """sync: a push computed on an older version, not applied; the current parameters come with it."""
    nonfinite: int = 0
    """A push refused because it held NaN or inf (or its worker's loss did), not applied: how many such pushes
    this PS has refused in all, this one included; the current parameters come with it. 0 for any other reply."""
    duplicate: bool = False
    """A push of a worker step this PS already had (a restarted worker repeating it), not applied again; the
    current parameters come with it."""
    lane: bool = False
    """The parameters are in the reply slot the request named (ps/lanes.py), not in frames."""

    def header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"step": self.step, "stop": self.stop}
        if self.dropped:
            header["dropped"] = True
        if self.stale:
            header["stale"] = True
        if self.nonfinite:
            header["nonfinite"] = self.nonfinite
        if self.duplicate:
            header["duplicate"] = True
        if self.lane:
            header["lane"] = True
        return header

    @classmethod
    def decode(cls, header: dict[Any, Any], op: str, sender: str) -> Self:
        try:
            check_keys(header, ("step", "stop"), ("dropped", "stale", "nonfinite", "duplicate", "lane"))
            return cls(
                step=int_field(header, "step"),
                stop=bool_field(header, "stop"),
                dropped="dropped" in header and bool_field(header, "dropped"),
                stale="stale" in header and bool_field(header, "stale"),
                nonfinite=int_field(header, "nonfinite") if "nonfinite" in header else 0,
                duplicate="duplicate" in header and bool_field(header, "duplicate"),
                lane="lane" in header and bool_field(header, "lane"),
            )
        except Invalid as invalid:
            raise PSProtocolError(op, invalid.field, sender, invalid.problem) from None


@dataclass(frozen=True, kw_only=True)
class StatusReply:
    """A PS's answer to `Status`."""

    step: int
    stop: bool
    initialized: bool
    snapshots: tuple[int, ...]
    """The steps of the snapshots the chief has not released yet, oldest first."""
    stats: dict[str, float]
    """Counters: updates applied, pushes dropped (stale, after max steps), requests malformed or failed, ..."""
    generation: int = 0
    """How many times this PS was restored after a PS was lost (protocol `Init`): a restarted chief goes on with it."""

    def header(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "stop": self.stop,
            "initialized": self.initialized,
            "snapshots": list(self.snapshots),
            "stats": self.stats,
            "generation": self.generation,
        }

    @classmethod
    def decode(cls, header: dict[Any, Any], sender: str) -> Self:
        try:
            check_keys(header, ("step", "stop", "initialized", "snapshots", "stats", "generation"))
            return cls(
                step=int_field(header, "step"),
                stop=bool_field(header, "stop"),
                initialized=bool_field(header, "initialized"),
                snapshots=ints_field(header, "snapshots"),
                stats=stats_field(header),
                generation=int_field(header, "generation"),
            )
        except Invalid as invalid:
            raise PSProtocolError("status", invalid.field, sender, invalid.problem) from None


@dataclass(frozen=True, kw_only=True)
class RejoinReply:
    """A PS's answer to `Rejoin`: what it has of one worker's steps."""

    step: int
    stop: bool
    local_step: int
    """The last of the worker's steps this PS took (to apply, or refused as non-finite); 0 for none."""
    input_state: dict[str, Any] | None
    """The worker's input position after that step; None for none."""
    done: bool
    """The worker had told this PS it finished."""
    generation: int
    """How many times the PS were restored after one was lost; the worker's pushes belong to this one."""

    def header(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "stop": self.stop,
            "local_step": self.local_step,
            "input_state": self.input_state,
            "done": self.done,
            "generation": self.generation,
        }

    @classmethod
    def decode(cls, header: dict[Any, Any], sender: str) -> Self:
        try:
            check_keys(header, ("step", "stop", "local_step", "input_state", "done", "generation"))
            return cls(
                step=int_field(header, "step"),
                stop=bool_field(header, "stop"),
                local_step=int_field(header, "local_step"),
                input_state=map_field(header, "input_state") if header["input_state"] is not None else None,
                done=bool_field(header, "done"),
                generation=int_field(header, "generation"),
            )
        except Invalid as invalid:
            raise PSProtocolError("rejoin", invalid.field, sender, invalid.problem) from None


def worker_steps_field(header: dict[Any, Any]) -> dict[str, int]:
    steps = map_field(header, "worker_steps")
    if not all(type(value) is int and value >= 0 for value in steps.values()):
        raise Invalid("worker_steps", f"must map worker names to steps (ints >= 0), got {short(steps)}")
    return steps


def stats_field(header: dict[Any, Any]) -> dict[str, float]:
    stats = map_field(header, "stats")
    if not all(type(value) in (int, float) for value in stats.values()):
        raise Invalid("stats", f"must map names to numbers, got {short(stats)}")
    return stats


@dataclass(frozen=True, kw_only=True)
class StateReply:
    """A PS's answer to `GetState`; its frames are the parameters (dense buffers, tables), then the slots."""

    step: int
    stop: bool
    state_step: int
    """The step the state is of: the snapshot's, or the current one."""
    dtypes: tuple[str, ...]
    slots: tuple[dict[str, int], ...]
    scalars: tuple[dict[str, float], ...]
    iterators: dict[str, Any]
    worker_steps: dict[str, int]
    stats: dict[str, float]

    def header(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "stop": self.stop,
            "state_step": self.state_step,
            "dtypes": list(self.dtypes),
            "slots": list(self.slots),
            "scalars": list(self.scalars),
            "iterators": self.iterators,
            "worker_steps": self.worker_steps,
            "stats": self.stats,
        }

    @classmethod
    def decode(cls, header: dict[Any, Any], sender: str) -> Self:
        try:
            check_keys(
                header,
                ("step", "stop", "state_step", "dtypes", "slots", "scalars", "iterators", "worker_steps", "stats"),
            )
            dtypes = header["dtypes"]
            if type(dtypes) is not list or not all(type(d) is str for d in dtypes):
                raise Invalid("dtypes", f"must be a list of dtype names, got {short(dtypes)}")
            num_parts = len(header["slots"]) if type(header["slots"]) is list else 0
            return cls(
                step=int_field(header, "step"),
                stop=bool_field(header, "stop"),
                state_step=int_field(header, "state_step"),
                dtypes=tuple(dtypes),
                slots=per_part(header, "slots", num_parts, lambda v: type(v) is int and v >= 0),
                scalars=per_part(header, "scalars", num_parts, lambda v: type(v) in (int, float)),
                iterators=map_field(header, "iterators"),
                worker_steps=worker_steps_field(header),
                stats=stats_field(header),
            )
        except Invalid as invalid:
            raise PSProtocolError("state", invalid.field, sender, invalid.problem) from None
