"""The PS wire protocol: every request a parameter server serves and every reply it sends, typed, with its
encoding and its validation. Nothing else in shardflow names an op or a header field.

A message is a msgpack header and tensor frames (see comm/framing.py). comm/ adds its own envelope to each
request header, the op name ("op") with the sender ("s") and sequence number ("q"); the keys below are the rest.
Steps are ints >= 0; worker_index is a worker's number in [0, num_workers); frames are raw tensors.

Requests (sender: request, fields; frames; reply):

- chief -> every PS: `Init` (op "init"): dtypes, num_tables, optimizer, apply, step, frame_counts, slots,
  scalars, iterators, worker_steps, generation. Frames: the dense pieces of each dtype buffer (frame_counts[i]
  1-D frames of dtypes[i], concatenated by the PS), then each table whole, then the slot tensors that `slots`
  index. A restored PS also
  gets its optimizer slots and what it had of each worker's steps, with their input positions. Sent again to
  every PS, with a higher generation, when one was lost. Reply: `StepReply`.
- worker -> each PS of its machine: `Attach` (op "attach"): worker_index, pid, fd, push_slots, reply_slots. No
  frames. The worker's shared-memory lane to this PS (ps/lanes.py). Reply: `StepReply`, or an error saying why
  the PS cannot map it. Then a `Push` may carry `slot` (its dense gradients are in that push slot of the lane,
  every frame count 0) and a `Push`, `NonFinite` or `Pull` may carry `reply_slot`: the parameters of the reply go
  into that reply slot of the lane, and the reply says `lane=True` in place of their frames.
- worker -> every PS: `Pull` (op "pull"): min_step, reply_slot (optional). No frames. Answered once the PS reached
  min_step: a `StepReply` and one frame per dtype buffer, the current parameters.
- worker -> the PS holding the tables: `Rows` (op "rows"): table_indices. One frame of int64 row numbers per
  table index. Reply: `StepReply` and one frame per table index, those rows' values.
- worker -> every PS: `Push` (op "push"): worker_index, local_step (the worker's count of its steps, 1 for its
  first, carried on across its restarts), base_step (this PS's step the gradient was computed at), frame_counts,
  input_state (the worker's input position after this batch). Frames: the dense
  gradient pieces grouped by dtype buffer as for `Init`, then per table its touched row numbers (int64) and
  their gradient rows. Reply: `StepReply` and the parameters, when the update rule lets the worker go on
  (ps/apply.py); `StepReply(dropped=True)` without frames once training is over; `stale=True` with the
  parameters when sync training dropped the gradient as stale; `nonfinite=<count>` with the parameters when a
  gradient held NaN or inf and was refused; `duplicate=True` with the parameters when this PS already had this
  worker's step `local_step` (a restarted worker repeats the steps some PS missed; see ps/server.py).
- worker -> every PS: `NonFinite` (op "nonfinite"): worker_index, local_step, base_step, found_in ("loss" or
  "gradients"), input_state. No frames. In place of a `Push` when the worker's loss or any of its gradients
  held NaN or inf: nothing is applied, the refusal is counted. Reply: as a refused `Push`.
- worker -> every PS: `Rejoin` (op "rejoin"): worker_index. Sent by a worker when it starts, restarted or not;
  it counts toward aggregation and staleness again (see `Lost`). Reply: `RejoinReply`: the last of its steps
  this PS had, the input position after it, and whether the worker had said `Done`.
- chief -> every PS: `Lost` (op "lost"): worker_index. The worker's heartbeat stopped and the strategy's
  lost_worker_policy is "continue": until it rejoins, sync steps complete without it and ssp does not hold the
  others back for it. Reply: `StepReply`.
- worker -> every PS: `Done` (op "done"): worker_index. The worker has finished; it no longer counts toward
  aggregation or staleness. Reply: `StepReply`.
- anyone -> a PS: `Status` (op "status"). Reply: `StatusReply`: step, initialized, snapshots held, stats.
- chief -> every PS: `GetState` (op "state"): snapshot_step (None: now). Reply: `StateReply` and frames: one
  per dtype buffer, one per table, then the slot tensors.
- chief -> every PS: `SnapshotAt` (op "snapshot_at"): step. Snapshot the state when the global step reaches
  it. `ReleaseSnapshots` (op "release_snapshots"): through_step; the chief saved every snapshot up to it.
  `Stop` (op "stop"): end training at the current step. `Shutdown` (op "shutdown"): stop serving.
  Each reply: `StepReply`.

Every reply header carries the PS's global step and whether training is over ("stop"). A request that breaks
these rules is answered with comm's error reply and raises `PSProtocolError` on the PS; it is never handled.
Before any of this, comm/ checks every message against its wire limits (comm/framing.py `WireLimits`).

A PS holds some requests before it answers them: a sync push until its step's other pushes arrived, an ssp push
while its worker is too far ahead, a pull until its `min_step`. It holds at most `ApplyConfig.held_limit` pushes
and as many pulls, each for at most `ApplyConfig.hold_timeout_s`; a request beyond the bound, or a pull for a step after
`max_steps` or more than `apply.MAX_PULL_AHEAD` steps ahead, is answered at once with an error, and one held past
its deadline is answered with an error saying what it waited for (ps/apply.py `Updates`).
The field checks live in ps/fields.py, the reply types in ps/replies.py; both are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

import torch

from shardflow.ps.apply import ApplyConfig
from shardflow.ps.fields import (
    Invalid,
    PSProtocolError,
    check_keys,
    dense_groups,
    int_field,
    ints_field,
    is_dtype,
    map_field,
    no_frames,
    optional_int_field,
    per_part,
    short,
)
from shardflow.ps.lanes import MAX_SLOTS
from shardflow.ps.optimizers import OptimizerSpec
from shardflow.ps.replies import RejoinReply, StateReply, StatusReply, StepReply, worker_steps_field

__all__ = [
    "BEFORE_INIT",
    "Attach",
    "Done",
    "GetState",
    "Init",
    "Limits",
    "Lost",
    "NonFinite",
    "PSProtocolError",
    "PSRequest",
    "Pull",
    "Push",
    "Rejoin",
    "RejoinReply",
    "ReleaseSnapshots",
    "Rows",
    "Shutdown",
    "SnapshotAt",
    "StateReply",
    "Status",
    "StatusReply",
    "StepReply",
    "Stop",
    "decode_request",
]


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What an initialised PS checks requests against."""

    num_workers: int
    buffers: tuple[tuple[torch.dtype, int], ...]
    """Each dense buffer's dtype and element count, in the order of frame_counts."""
    num_tables: int


# -- requests ----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Init:
    """Give a PS its shards, optimizer and update rule; fresh, or restored from a checkpoint."""

    op: ClassVar[str] = "init"
    dtypes: tuple[str, ...]
    """The dtype of each dense buffer, in frame order."""
    num_tables: int
    optimizer: OptimizerSpec
    apply: ApplyConfig
    step: int
    """The global step to start from: 0, or the restored checkpoint's."""
    frame_counts: tuple[int, ...]
    slots: tuple[dict[str, int], ...] = ()
    """Per part (dense buffer, then table): optimizer slot key -> index among the slot frames."""
    scalars: tuple[dict[str, float], ...] = ()
    """Per part: scalar optimizer state (e.g. Adam's step count)."""
    iterators: dict[str, Any] = field(default_factory=dict)
    """Restored: by "worker:<index>", its input position after the last of its steps this PS had."""
    worker_steps: dict[str, int] = field(default_factory=dict)
    """Restored: by "worker:<index>", the last of its steps this PS had (see `Rejoin`)."""
    generation: int = 0
    """How many times the PS were restored after one was lost; from the second, pushes of workers that have not
    rejoined since are refused."""

    def header(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "dtypes": list(self.dtypes),
            "num_tables": self.num_tables,
            "optimizer": self.optimizer.to_json(),
            "apply": self.apply.to_json(),
            "step": self.step,
            "frame_counts": list(self.frame_counts),
            "slots": list(self.slots),
            "scalars": list(self.scalars),
            "iterators": self.iterators,
            "worker_steps": self.worker_steps,
            "generation": self.generation,
        }

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        check_keys(
            header,
            (
                "dtypes",
                "num_tables",
                "optimizer",
                "apply",
                "step",
                "frame_counts",
                "slots",
                "scalars",
                "iterators",
                "worker_steps",
                "generation",
            ),
        )
        names = header["dtypes"]
        if type(names) is not list or not all(type(n) is str and is_dtype(n) for n in names):
            raise Invalid("dtypes", f"must be a list of torch dtype names, got {short(names)}")
        dtypes = [getattr(torch, n) for n in names]
        num_tables = int_field(header, "num_tables", below=len(frames) + 1)
        counts = ints_field(header, "frame_counts")
        # After the dense groups: the tables, then the slot frames.
        trailing = len(frames) - sum(counts)
        if trailing < 0:
            raise Invalid("frame_counts", f"counts {sum(counts)} dense frames but {len(frames)} frames came")
        if trailing < num_tables:
            raise Invalid("num_tables", f"is {num_tables} but {trailing} frames follow the dense groups")
        dense_groups(header, frames, dtypes, trailing)
        num_slot_frames = trailing - num_tables
        num_parts = len(dtypes) + num_tables
        slots = per_part(header, "slots", num_parts, lambda v: type(v) is int and 0 <= v < num_slot_frames)
        scalars = per_part(header, "scalars", num_parts, lambda v: type(v) in (int, float))
        return cls(
            dtypes=tuple(names),
            num_tables=num_tables,
            optimizer=_config(header, "optimizer", OptimizerSpec.from_json),
            apply=_config(header, "apply", ApplyConfig.from_json),
            step=int_field(header, "step"),
            frame_counts=counts,
            slots=slots,
            scalars=scalars,
            iterators=map_field(header, "iterators"),
            worker_steps=worker_steps_field(header),
            generation=int_field(header, "generation"),
        )


def _config(header: dict[Any, Any], name: str, from_json: Callable[[dict[str, Any]], Any]) -> Any:
    value = map_field(header, name)
    try:
        return from_json(value)
    except (TypeError, ValueError, KeyError) as error:
        raise Invalid(name, f"is not valid: {error}") from None


@dataclass(frozen=True, kw_only=True)
class _StepFields:
    """A control request whose fields are all global steps (ints >= 0), read from its own dataclass fields: none is
    sent more than once per step, so the generic form costs nothing that matters."""

    op: ClassVar[str]

    def header(self) -> dict[str, Any]:
        return {"op": self.op, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        names = tuple(f.name for f in fields(cls))
        check_keys(header, names)
        no_frames(frames)
        return cls(**{name: int_field(header, name) for name in names})


def _reply_slot_field(header: dict[Any, Any]) -> int | None:
    """A request's optional reply slot: which of its sender's lane slots the parameters of the reply go into."""
    return int_field(header, "reply_slot", below=MAX_SLOTS) if "reply_slot" in header else None


@dataclass(frozen=True, kw_only=True)
class Pull:
    """Ask for the parameters once the global step is at least `min_step`."""

    op: ClassVar[str] = "pull"
    min_step: int = 0
    reply_slot: int | None = None
    """Where the parameters go: this slot of the sender's lane (see `Attach`), or None: frames of the reply."""

    def header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"op": self.op, "min_step": self.min_step}
        if self.reply_slot is not None:
            header["reply_slot"] = self.reply_slot
        return header

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        check_keys(header, ("min_step",), ("reply_slot",))
        no_frames(frames)
        return cls(min_step=int_field(header, "min_step"), reply_slot=_reply_slot_field(header))


@dataclass(frozen=True, kw_only=True)
class Attach:
    """A worker of this machine offers a lane (ps/lanes.py): the memfd `fd` of its process `pid`, with
    `push_slots` slots for gradients and `reply_slots` for parameters, each one flat buffer per dense buffer of
    this PS. Its later requests name slots of it in place of frames. Reply: `StepReply`, or an error saying why
    the PS cannot map it (the worker then goes on over the socket)."""

    op: ClassVar[str] = "attach"
    worker_index: int
    pid: int
    fd: int
    push_slots: int
    reply_slots: int

    def header(self) -> dict[str, Any]:
        return {"op": self.op, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        check_keys(header, ("worker_index", "pid", "fd", "push_slots", "reply_slots"))
        no_frames(frames)
        pid = int_field(header, "pid", below=1 << 32)
        if pid == 0:
            raise Invalid("pid", "must be a process id > 0, got 0")
        slots = {}
        for name in ("push_slots", "reply_slots"):
            value = header[name]
            if type(value) is not int or not 1 <= value <= MAX_SLOTS:
                raise Invalid(name, f"must be an int between 1 and {MAX_SLOTS}, got {short(value)}")
            slots[name] = value
        return cls(
            worker_index=int_field(header, "worker_index", below=limits.num_workers if limits else None),
            pid=pid,
            fd=int_field(header, "fd", below=1 << 31),
            **slots,
        )


@dataclass(frozen=True, kw_only=True)
class Rows:
    """Ask for the rows of some tables that a batch looks up; one frame of row numbers per table index."""

    op: ClassVar[str] = "rows"
    table_indices: tuple[int, ...]

    def header(self) -> dict[str, Any]:
        return {"op": self.op, "table_indices": list(self.table_indices)}

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        check_keys(header, ("table_indices",))
        indices = ints_field(header, "table_indices", below=limits.num_tables if limits is not None else None)
        if len(indices) != len(frames):
            raise Invalid("table_indices", f"names {len(indices)} tables but {len(frames)} frames came")
        return cls(table_indices=indices)


@dataclass(frozen=True, kw_only=True)
class Push:
    """One worker's gradients for this PS, computed on the parameters of `base_step`."""

    op: ClassVar[str] = "push"
    worker_index: int
    local_step: int
    """The worker's own count of its steps, this one included; a PS applies each at most once."""
    base_step: int
    frame_counts: tuple[int, ...]
    input_state: dict[str, Any] | None = None
    """The worker's input position after the batch of this gradient: where it resumes when restarted, and (on
    ps:0) what checkpoints keep."""
    lr: float | None = None
    """The learning rate of this update, with a schedule that is a function of the step (ps/schedules.py): the
    worker evaluates it at `base_step`; the PS cannot run the user's function."""
    slot: int | None = None
    """The dense gradients are in this push slot of the sender's lane (see `Attach`), not in frames: every frame
    count is then 0."""
    reply_slot: int | None = None
    """As for `Pull`."""

    def header(self) -> dict[str, Any]:
        header = {
            "op": self.op,
            "worker_index": self.worker_index,
            "local_step": self.local_step,
            "base_step": self.base_step,
            "frame_counts": list(self.frame_counts),
        }
        if self.input_state is not None:
            header["input_state"] = self.input_state
        if self.lr is not None:
            header["lr"] = self.lr
        if self.slot is not None:
            header["slot"] = self.slot
        if self.reply_slot is not None:
            header["reply_slot"] = self.reply_slot
        return header

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        # The hot path: a handful of checks per push, and one per dense frame.
        check_keys(
            header,
            ("worker_index", "local_step", "base_step", "frame_counts"),
            ("input_state", "lr", "slot", "reply_slot"),
        )
        input_state = header.get("input_state")
        if input_state is not None:
            input_state = map_field(header, "input_state")
        lr = header.get("lr")
        if lr is not None and (type(lr) is not float or not math.isfinite(lr) or lr < 0):
            raise Invalid("lr", f"must be a finite float >= 0, got {short(lr)}")
        slot = int_field(header, "slot", below=MAX_SLOTS) if "slot" in header else None
        reply_slot = _reply_slot_field(header)
        if limits is None:  # not initialised: the PS refuses the push, whatever it holds
            return cls(
                worker_index=int_field(header, "worker_index"),
                local_step=int_field(header, "local_step"),
                base_step=int_field(header, "base_step"),
                frame_counts=ints_field(header, "frame_counts"),
                input_state=input_state,
                lr=lr,
                slot=slot,
                reply_slot=reply_slot,
            )
        counts = ints_field(header, "frame_counts")
        buffers = limits.buffers
        if len(counts) != len(buffers) or sum(counts) + 2 * limits.num_tables != len(frames):
            raise Invalid(
                "frame_counts",
                f"must group {len(frames)} frames into {len(buffers)} dense buffers and {2 * limits.num_tables} "
                f"table frames, got {counts}",
            )
        if slot is not None and any(counts):
            raise Invalid("frame_counts", f"must all be 0 when the gradients are in lane slot {slot}, got {counts}")
        start = 0
        for index, count in enumerate(counts if slot is None else ()):
            dtype, numel = buffers[index]
            total = 0
            for frame in frames[start : start + count]:
                if frame.dtype != dtype or frame.dim() != 1:
                    raise Invalid(
                        "frames",
                        f"of buffer {index} must be 1-D {dtype}, got {frame.dtype} shaped {tuple(frame.shape)}",
                    )
                total += frame.numel()
            if total != numel:
                raise Invalid("frames", f"of buffer {index} must hold {numel} elements in all, got {total}")
            start += count
        return cls(
            worker_index=int_field(header, "worker_index", below=limits.num_workers),
            local_step=int_field(header, "local_step"),
            base_step=int_field(header, "base_step"),
            frame_counts=counts,
            input_state=input_state,
            lr=lr,
            slot=slot,
            reply_slot=reply_slot,
        )


NONFINITE_FOUND_IN = ("loss", "gradients")


@dataclass(frozen=True, kw_only=True)
class NonFinite:
    """In place of a push: this worker's step, computed on the parameters of `base_step`, held NaN or inf in its
    loss or its gradients. Sent to every PS, so that every PS refuses the step alike (see ps/client.py)."""

    op: ClassVar[str] = "nonfinite"
    worker_index: int
    local_step: int
    base_step: int
    found_in: str
    """"loss" or "gradients"."""
    input_state: dict[str, Any] | None = None
    """The worker's input position after the refused batch, as for `Push`."""
    reply_slot: int | None = None
    """As for `Pull`."""

    def header(self) -> dict[str, Any]:
        header = {
            "op": self.op,
            "worker_index": self.worker_index,
            "local_step": self.local_step,
            "base_step": self.base_step,
            "found_in": self.found_in,
        }
        if self.input_state is not None:
            header["input_state"] = self.input_state
        if self.reply_slot is not None:
            header["reply_slot"] = self.reply_slot
        return header

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        check_keys(header, ("worker_index", "local_step", "base_step", "found_in"), ("input_state", "reply_slot"))
        no_frames(frames)
        found_in = header["found_in"]
        if found_in not in NONFINITE_FOUND_IN:
            raise Invalid("found_in", f"must be one of {NONFINITE_FOUND_IN}, got {short(found_in)}")
        return cls(
            worker_index=int_field(header, "worker_index", below=limits.num_workers if limits else None),
            local_step=int_field(header, "local_step"),
            base_step=int_field(header, "base_step"),
            found_in=found_in,
            input_state=map_field(header, "input_state") if header.get("input_state") is not None else None,
            reply_slot=_reply_slot_field(header),
        )


@dataclass(frozen=True, kw_only=True)
class Done:
    """The worker has finished training."""

    op: ClassVar[str] = "done"
    worker_index: int

    def header(self) -> dict[str, Any]:
        return {"op": self.op, "worker_index": self.worker_index}

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        check_keys(header, ("worker_index",))
        no_frames(frames)
        return cls(worker_index=int_field(header, "worker_index", below=limits.num_workers if limits else None))


@dataclass(frozen=True, kw_only=True)
class Rejoin(Done):
    """A worker starts, maybe restarted: which of its steps this PS has, and where its input stood after them."""

    op: ClassVar[str] = "rejoin"


@dataclass(frozen=True, kw_only=True)
class Lost(Done):
    """The chief lost a worker: steps complete without it until it rejoins."""

    op: ClassVar[str] = "lost"


@dataclass(frozen=True, kw_only=True)
class GetState:
    """Ask for parameters, optimizer slots and input positions: now, or as snapshotted at `snapshot_step`."""

    op: ClassVar[str] = "state"
    snapshot_step: int | None = None

    def header(self) -> dict[str, Any]:
        return {"op": self.op, "snapshot_step": self.snapshot_step}

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        check_keys(header, ("snapshot_step",))
        no_frames(frames)
        return cls(snapshot_step=optional_int_field(header, "snapshot_step"))


@dataclass(frozen=True, kw_only=True)
class SnapshotAt(_StepFields):
    """Snapshot the state when the global step reaches `step` (a time-based checkpoint picks one just ahead)."""

    op: ClassVar[str] = "snapshot_at"
    step: int


@dataclass(frozen=True, kw_only=True)
class ReleaseSnapshots(_StepFields):
    """The chief saved every snapshot up to and including `through_step`; the PS may drop them."""

    op: ClassVar[str] = "release_snapshots"
    through_step: int


@dataclass(frozen=True, kw_only=True)
class _NoFields:
    op: ClassVar[str]

    def header(self) -> dict[str, Any]:
        return {"op": self.op}

    @classmethod
    def decode(cls, header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None) -> Self:
        check_keys(header, ())
        no_frames(frames)
        return cls()


@dataclass(frozen=True, kw_only=True)
class Status(_NoFields):
    """Ask for the global step, the snapshots held and the PS's counters."""

    op: ClassVar[str] = "status"


@dataclass(frozen=True, kw_only=True)
class Stop(_NoFields):
    """End training at the current step (early stopping): later pushes are dropped, workers told to stop."""

    op: ClassVar[str] = "stop"


@dataclass(frozen=True, kw_only=True)
class Shutdown(_NoFields):
    """Stop serving."""

    op: ClassVar[str] = "shutdown"


PSRequest = (
    Init
    | Attach
    | Pull
    | Rows
    | Push
    | NonFinite
    | Done
    | Rejoin
    | Lost
    | Status
    | GetState
    | SnapshotAt
    | ReleaseSnapshots
    | Stop
    | Shutdown
)
_REQUESTS: dict[str, type[PSRequest]] = {
    cls.op: cls
    for cls in (
        Init,
        Attach,
        Pull,
        Rows,
        Push,
        NonFinite,
        Done,
        Rejoin,
        Lost,
        Status,
        GetState,
        SnapshotAt,
        ReleaseSnapshots,
        Stop,
        Shutdown,
    )
}
BEFORE_INIT = (Init, Status, Shutdown)
"""The requests a PS serves before it is initialised."""


def decode_request(
    header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None, sender: str
) -> PSRequest:
    """The typed request in `header` and `frames`, checked against `limits` once the PS knows them.
    Raises PSProtocolError for anything that breaks the protocol."""
    op = header.get("op")
    message_type = _REQUESTS.get(op) if type(op) is str else None
    if message_type is None:
        raise PSProtocolError(op, "op", sender, f"is not a PS request; one of {sorted(_REQUESTS)} is")
    try:
        return message_type.decode(header, frames, limits)
    except Invalid as invalid:
        raise PSProtocolError(op, invalid.field, sender, invalid.problem) from None
    except Exception as error:  # a check that missed a shape of bad input: still refused, never raised further
        raise PSProtocolError(op, "header", sender, f"could not be read: {type(error).__name__}: {error}") from None
