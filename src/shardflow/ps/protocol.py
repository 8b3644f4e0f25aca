"""The PS wire protocol: every request a parameter server serves, declared once as a typed message that says
who sends it, its frames and its reply (ps/replies.py). Nothing else in shardflow names an op or a field.

A message is a msgpack header, tagged with its op, and tensor frames (comm/framing.py checks its wire limits). A
request that breaks the rules below is answered with an error and raises `PSProtocolError` on the PS."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Self, get_args

import msgspec
import torch

from shardflow.comm.envelope import short
from shardflow.ps.embeddings.spec import TableSpec
from shardflow.ps.fields import Count, Invalid, Message
from shardflow.ps.fields import PSProtocolError as PSProtocolError
from shardflow.ps.lanes import MAX_SLOTS
from shardflow.ps.optimizers import OptimizerSpec
from shardflow.ps.replies import RejoinReply as RejoinReply
from shardflow.ps.replies import StateReply as StateReply
from shardflow.ps.replies import StatusReply as StatusReply
from shardflow.ps.replies import StepReply as StepReply
from shardflow.ps.replies import Unserved as Unserved
from shardflow.ps.update_rules import ApplyConfig

SlotIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)]
"""A slot of the sender's lane (see `Attach`)."""
SlotCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_SLOTS)]
LearningRate = Annotated[float, msgspec.Meta(ge=0, le=1.7976931348623157e308)]
"""A finite float >= 0."""
WireDtype = Literal["bfloat16"]
"""A dtype the dense float buffers may travel in, narrower than the PS keeps them (see `on_the_wire`)."""
WIRE_DTYPES: dict[str, WireDtype] = {"bf16": "bfloat16"}
"""The wire precisions a worker may ask for (ParameterServerStrategy.wire_dtype), each with the dtype it sends."""


def on_the_wire(dtype: torch.dtype, wire_dtype: str | None) -> torch.dtype:
    """The dtype a dense buffer of `dtype` travels in as frames when a request names `wire_dtype`: float32 and float64
    buffers in it, any other buffer as it is. Lane slots always hold the buffers as the PS keeps them."""
    if wire_dtype is None or dtype not in (torch.float32, torch.float64):
        return dtype
    wire: torch.dtype = getattr(torch, wire_dtype)
    return wire


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What an initialised PS checks requests against."""

    num_workers: int
    buffers: tuple[tuple[torch.dtype, int], ...]
    """Each dense buffer's dtype and element count, in the order of frame_counts."""
    num_tables: int
    embedding_tables: int = 0
    """How many `sf.nn` tables the job has; this PS holds a partition of each."""


class Request(Message, tag_field="op", frozen=True):
    """A request; its tag, `op`, names it on the wire. Unless it says otherwise it has no frames and its reply
    is a `StepReply`."""

    op: ClassVar[str]

    def check(self, frames: Sequence[torch.Tensor], limits: Limits | None) -> None:
        """Raise Invalid if `frames`, or a field, does not fit this PS (`limits`: None until initialised)."""
        if frames:
            raise Invalid("frames", f"must be none, got {len(frames)}")


class _WorkerRequest(Request, frozen=True):
    worker_index: Count

    def check(self, frames: Sequence[torch.Tensor], limits: Limits | None) -> None:
        super().check(frames, limits)
        _check_worker(self.worker_index, limits)


def _check_worker(worker_index: int, limits: Limits | None) -> None:
    if limits is not None and worker_index >= limits.num_workers:
        raise Invalid("worker_index", f"must be an int in [0, {limits.num_workers}), got {worker_index}")


class TableRestore(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A checkpoint's `sf.nn` table files, read by each PS itself (nothing goes through the chief): per table, its
    files in the order to replay them (each PS's full file, then its increments), paths relative to `checkpoint`."""

    checkpoint: str
    chains: dict[str, tuple[str, ...]]


class Init(Request, tag="init", frozen=True):
    """chief -> every PS: its shards, optimizer and update rule, fresh or restored from a checkpoint; sent again,
    with a higher generation, when a PS was lost. Frames: the dense pieces of each dtype buffer (frame_counts[i]
    1-D frames of dtypes[i], concatenated by the PS), then each table whole, then the slot tensors `slots` index."""

    dtypes: tuple[str, ...]
    """The dtype of each dense buffer, in frame order."""
    num_tables: Count
    optimizer: OptimizerSpec
    apply: ApplyConfig
    step: Count
    """The global step to start from: 0, or the restored checkpoint's."""
    frame_counts: tuple[Count, ...]
    slots: tuple[dict[str, Count], ...] = ()
    """Per part (dense buffer, then table): optimizer slot key -> index among the slot frames."""
    scalars: tuple[dict[str, float], ...] = ()
    """Per part: scalar optimizer state (e.g. Adam's step count)."""
    iterators: dict[str, Any] = {}
    """Restored: by "worker:<index>", its input position after the last of its steps this PS had."""
    worker_steps: dict[str, Count] = {}
    """Restored: by "worker:<index>", the last of its steps this PS had (see `Rejoin`)."""
    generation: Count = 0
    """How many times the PS were restored after one was lost; from the second, pushes of workers that have not
    rejoined since are refused."""
    num_ps: Annotated[int, msgspec.Meta(ge=1, le=2**20)] = 1
    embeddings: tuple[TableSpec, ...] = ()
    """The job's `sf.nn` tables, each with its row optimizer set: this PS holds the rows of each that it owns."""
    embedding_restore: TableRestore | None = None
    """Where this PS reads its rows from when restoring; None: every row starts from its initializer."""
    embedding_staging: str | None = None
    """The directory this PS writes its table files into for checkpoints (the chief links them into each
    checkpoint); None: it writes none."""
    full_checkpoint_every: Annotated[int, msgspec.Meta(ge=1, le=2**31)] = 10
    """Every this many checkpoints the PS writes every row of its tables; in between, only the rows changed."""

    def header(self) -> dict[str, Any]:
        configs = {"optimizer": self.optimizer.to_json(), "apply": self.apply.to_json()}
        tables = {"embeddings": msgspec.to_builtins(self.embeddings)}
        if self.embedding_restore is not None:
            tables["embedding_restore"] = msgspec.to_builtins(self.embedding_restore)
        return {"op": self.op, **msgspec.structs.asdict(self), **configs, **tables}

    @classmethod
    def from_header(cls, header: dict[Any, Any], op: object, sender: str) -> Self:
        # The optimizer and update rule go as their to_json() wrote them, checked by their from_json().
        body = dict(header)
        for name, from_json in (("optimizer", OptimizerSpec.from_json), ("apply", ApplyConfig.from_json)):
            value = body.get(name)
            if type(value) is not dict or not all(type(key) is str for key in value):
                raise Invalid(name, f"must be a map with string keys, got {short(value)}")
            try:
                body[name] = from_json(value)
            except (TypeError, ValueError, KeyError) as error:
                raise Invalid(name, f"is not valid: {error}") from None
        return super().from_header(body, op, sender)

    def check(self, frames: Sequence[torch.Tensor], limits: Limits | None) -> None:
        if not all(isinstance(getattr(torch, name, None), torch.dtype) for name in self.dtypes):
            raise Invalid("dtypes", f"must be a list of torch dtype names, got {short(list(self.dtypes))}")
        # After the dense groups: the tables, then the slot frames.
        trailing = len(frames) - sum(self.frame_counts)
        if trailing < 0:
            raise Invalid("frame_counts", f"counts {sum(self.frame_counts)} dense frames but {len(frames)} came")
        if trailing < self.num_tables:
            raise Invalid("num_tables", f"is {self.num_tables} but {trailing} frames follow the dense groups")
        _check_dense(frames, self.frame_counts, [(getattr(torch, name), None) for name in self.dtypes], trailing)
        num_slot_frames, num_parts = trailing - self.num_tables, len(self.dtypes) + self.num_tables
        for name, maps in (("slots", self.slots), ("scalars", self.scalars)):
            if len(maps) not in (0, num_parts):
                raise Invalid(name, f"must be a list of {num_parts} maps (or none), got {short(list(maps))}")
        if any(index >= num_slot_frames for part in self.slots for index in part.values()):
            raise Invalid("slots", f"must index the {num_slot_frames} slot frames, got {short(list(self.slots))}")


def _check_dense(
    frames: Sequence[torch.Tensor],
    counts: tuple[int, ...],
    buffers: Sequence[tuple[torch.dtype, int | None]],
    trailing: int,
    in_frames: bool = True,
) -> None:
    """`counts` groups `frames` into one group per dense buffer (dtype, element count if known), then `trailing`
    frames; each dense frame 1-D of its buffer's dtype, if the buffers come `in_frames` (not in a lane slot)."""
    if len(counts) != len(buffers) or sum(counts) + trailing != len(frames):
        raise Invalid(
            "frame_counts",
            f"must group {len(frames)} frames into {len(buffers)} dense buffers and {trailing} more, got {counts}",
        )
    start = 0
    for index, count in enumerate(counts if in_frames else ()):
        dtype, numel = buffers[index]
        total = 0
        for frame in frames[start : start + count]:
            if frame.dtype != dtype or frame.dim() != 1:
                raise Invalid(
                    "frames", f"of buffer {index} must be 1-D {dtype}, got {frame.dtype} shaped {tuple(frame.shape)}"
                )
            total += frame.numel()
        if numel is not None and total != numel:
            raise Invalid("frames", f"of buffer {index} must hold {numel} elements in all, got {total}")
        start += count


class Attach(_WorkerRequest, tag="attach", frozen=True):
    """worker -> each PS of its machine: a lane (ps/lanes.py), the memfd `fd` of its process `pid`, with
    `push_slots` slots for gradients and `reply_slots` for parameters, each one flat buffer per dense buffer of
    this PS. Its later requests name slots of it in place of frames. Reply: `StepReply`, or an error saying why
    the PS cannot map it (the worker then goes on over the socket)."""

    pid: Annotated[int, msgspec.Meta(ge=1, lt=2**32)]
    fd: Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
    push_slots: SlotCount
    reply_slots: SlotCount


class Pull(Request, tag="pull", frozen=True):
    """worker -> every PS: the parameters once the global step is at least `min_step`. Reply: `StepReply` and one
    frame per dense buffer, or (`reply_slot`) `StepReply(lane=True)`."""

    min_step: Count = 0
    reply_slot: SlotIndex | None = None
    """Where the parameters go: this slot of the sender's lane (see `Attach`), or None: frames of the reply."""
    wire_dtype: WireDtype | None = None
    """The float buffers of the reply's frames go in this dtype (`on_the_wire`); None: as the PS keeps them."""


class Rows(Request, tag="rows", frozen=True):
    """worker -> the PS holding the tables: the rows a batch looks up; one frame of int64 row numbers per table
    index. Reply: `StepReply` and one frame per table index, those rows' values."""

    table_indices: tuple[Count, ...]

    def check(self, frames: Sequence[torch.Tensor], limits: Limits | None) -> None:
        if limits is not None and any(index >= limits.num_tables for index in self.table_indices):
            raise Invalid("table_indices", f"must hold ints in [0, {limits.num_tables}), got {self.table_indices}")
        if len(self.table_indices) != len(frames):
            raise Invalid("table_indices", f"names {len(self.table_indices)} tables but {len(frames)} frames came")


class Lookup(Request, tag="lookup", frozen=True):
    """worker -> a PS: the rows of `sf.nn` tables a batch looks up, answered once this PS's global step is at least
    `min_step` (a lookup sent ahead for the next batch waits for the update it must see). Frames: per table index,
    the batch's unique ids that this PS owns (1-D int64). Reply: `StepReply` and, per table index, those rows'
    values (a dynamic table's id without a row reads its initial values)."""

    table_indices: tuple[Count, ...]
    min_step: Count = 0

    def check(self, frames: Sequence[torch.Tensor], limits: Limits | None) -> None:
        if limits is not None and any(index >= limits.embedding_tables for index in self.table_indices):
            raise Invalid(
                "table_indices", f"must hold ints in [0, {limits.embedding_tables}), got {self.table_indices}"
            )
        if len(self.table_indices) != len(frames):
            raise Invalid("table_indices", f"names {len(self.table_indices)} tables but {len(frames)} frames came")
        _check_ids(frames, "frames")


def _check_ids(frames: Sequence[torch.Tensor], field: str) -> None:
    for frame in frames:
        if frame.dtype != torch.int64 or frame.dim() != 1:
            raise Invalid(field, f"of ids must be 1-D int64, got {frame.dtype} shaped {tuple(frame.shape)}")


class _WorkerStep(_WorkerRequest, frozen=True):
    """A worker's step, sent to every PS: a `Push`, or a `NonFinite` in its place."""

    local_step: Count
    """The worker's own count of its steps, this one included (1 for its first, carried on across its restarts);
    a PS takes each at most once."""
    base_step: Count
    """This PS's global step whose parameters the step was computed on."""
    input_state: dict[str, Any] | None = None
    """The worker's input position after the step's batch: where it resumes when restarted, and (on ps:0) what
    checkpoints keep."""
    reply_slot: SlotIndex | None = None
    """As for `Pull`."""
    wire_dtype: WireDtype | None = None
    """The float buffers of the push's dense frames (a `Push`) and of the reply's parameters travel in this dtype
    (`on_the_wire`); the PS casts gradients up to its own dtype before it applies or sums them. None: as the PS
    keeps them."""


class Push(_WorkerStep, tag="push", frozen=True, kw_only=True):
    """worker -> every PS: its gradients. Frames: the dense gradient pieces grouped by dtype buffer as for `Init`,
    then per table its touched row numbers (int64) and their gradient rows, then per `sf.nn` table the batch's
    unique ids this PS owns (int64), how often each occurred (int64) and their gradient rows. Reply: `StepReply`
    and the parameters when the update rule lets the worker go on (ps/update_rules.py); `dropped` without them once
    training is over; `stale`, `nonfinite` or `duplicate` with them when the gradient was not applied (sync and
    stale; NaN or inf; a step this PS had already)."""

    frame_counts: tuple[Count, ...]
    lr: LearningRate | None = None
    """The learning rate of this update, with a schedule that is a function of the step (ps/schedules.py): the
    worker evaluates it at `base_step`; the PS cannot run the user's function."""
    slot: SlotIndex | None = None
    """The dense gradients are in this push slot of the sender's lane (see `Attach`), not in frames: every frame
    count is then 0."""
    lookup: tuple[Count, ...] = ()
    """A `Lookup` riding on the push (an overlapped async worker's, for its batch after next): its `sf.nn` table
    indices, whose ids (1-D int64, this PS's share of the batch's unique ids) are the push's last frames, one per
    index. The reply's last `StepReply.rows` frames are those rows' values, read as the push is answered."""

    def check(self, frames: Sequence[torch.Tensor], limits: Limits | None) -> None:
        # The hot path: a handful of checks per push, and one per dense frame.
        if limits is None:  # not initialised: the PS refuses the push, whatever it holds
            return
        _check_worker(self.worker_index, limits)
        counts = self.frame_counts
        trailing = 2 * limits.num_tables + 3 * limits.embedding_tables + len(self.lookup)
        if self.wire_dtype is None or self.slot is not None:
            _check_dense(frames, counts, limits.buffers, trailing, in_frames=self.slot is None)
        else:
            wire = [(on_the_wire(dtype, self.wire_dtype), numel) for dtype, numel in limits.buffers]
            try:
                _check_dense(frames, counts, wire, trailing)
            except Invalid as invalid:
                raise Invalid(invalid.field, f"{invalid.problem} (wire_dtype {self.wire_dtype!r})") from None
        if self.slot is not None and any(counts):
            raise Invalid("frame_counts", f"must all be 0 when the gradients are in lane slot {self.slot}: {counts}")
        if self.lookup:  # its frames are the last ones: their count is checked with the rest's
            try:
                Lookup(table_indices=self.lookup).check(frames[len(frames) - len(self.lookup) :], limits)
            except Invalid as invalid:
                raise Invalid("lookup", invalid.problem) from None


class NonFinite(_WorkerStep, tag="nonfinite", frozen=True, kw_only=True):
    """worker -> every PS, in place of a `Push`: its step held NaN or inf in its loss or its gradients. Nothing is
    applied, the refusal is counted, every PS alike. Reply: as a refused `Push`."""

    found_in: str
    """"loss" or "gradients"."""

    def check(self, frames: Sequence[torch.Tensor], limits: Limits | None) -> None:
        super().check(frames, limits)
        if self.found_in not in ("loss", "gradients"):
            raise Invalid("found_in", f"must be 'loss' or 'gradients', got {short(self.found_in)}")


class Done(_WorkerRequest, tag="done", frozen=True):
    """worker -> every PS: it has finished; it no longer counts toward aggregation or staleness."""


class Rejoin(_WorkerRequest, tag="rejoin", frozen=True):
    """worker -> every PS, when it starts, restarted or not: it counts toward aggregation and staleness again
    (see `Lost`). Reply: `RejoinReply`, what this PS has of its steps and where its input stood after them."""


class Lost(_WorkerRequest, tag="lost", frozen=True):
    """chief -> every PS: the worker's heartbeat stopped and the lost_worker_policy is "continue": until it
    rejoins, sync steps complete without it and ssp does not hold the others back for it."""


class Status(Request, tag="status", frozen=True):
    """anyone -> a PS: the global step, the snapshots held and the PS's counters. Reply: `StatusReply`."""


class GetState(Request, tag="state", frozen=True):
    """chief -> every PS: parameters, optimizer slots and input positions, now or as snapshotted at
    `snapshot_step`. Reply: `StateReply` and frames: one per dense buffer, one per table, then the slot tensors."""

    snapshot_step: Count | None = None


class SnapshotAt(Request, tag="snapshot_at", frozen=True):
    """chief -> every PS: snapshot the state when the global step reaches `step`, the step the furthest PS held at
    (`Hold`, sent first: so no PS has passed it); the held pushes then go on."""

    step: Count


class ReleaseSnapshots(Request, tag="release_snapshots", frozen=True):
    """chief -> every PS: it saved every snapshot up to and including `through_step`; the PS may drop them."""

    through_step: Count


class Hold(Request, tag="hold", frozen=True):
    """chief -> every PS, before `Stop` or `SnapshotAt` names one step for all (async PS are a few pushes apart):
    hold the workers' pushes, neither applied nor answered, until then. The reply's step is where this PS holds."""


class Stop(Request, tag="stop", frozen=True):
    """chief -> every PS: end training at global step `step` (the step the furthest PS held at), or None: at the
    current step. The held pushes are applied up to it, later ones dropped, and the workers told to stop."""

    step: Count | None = None


class Shutdown(Request, tag="shutdown", frozen=True):
    """chief -> every PS: stop serving."""


PSRequest = (
    Init
    | Attach
    | Pull
    | Rows
    | Lookup
    | Push
    | NonFinite
    | Done
    | Rejoin
    | Lost
    | Status
    | GetState
    | SnapshotAt
    | ReleaseSnapshots
    | Hold
    | Stop
    | Shutdown
)
REQUESTS: dict[str, type[PSRequest]] = {cls.__struct_config__.tag: cls for cls in get_args(PSRequest)}
"""Each request type by its op."""
for _op, _request_type in REQUESTS.items():
    _request_type.op = _op
BEFORE_INIT = (Init, Status, Shutdown)
"""The requests a PS serves before it is initialised."""


def decode_request(
    header: dict[Any, Any], frames: Sequence[torch.Tensor], limits: Limits | None, sender: str
) -> PSRequest:
    """The typed request in `header` and `frames`, checked against `limits` once the PS knows them.
    Raises PSProtocolError for anything that breaks the protocol."""
    op = header.get("op")
    request_type = REQUESTS.get(op) if type(op) is str else None
    if request_type is None:
        raise PSProtocolError(op, "op", sender, f"is not a PS request; one of {sorted(REQUESTS)} is")
    try:
        message = request_type.from_header(header, op, sender)
        message.check(frames, limits)
        return message
    except Invalid as invalid:
        raise PSProtocolError(op, invalid.field, sender, invalid.problem) from None
    except PSProtocolError:
        raise
    except Exception as error:  # a check that missed a shape of bad input: still refused, never raised further
        raise PSProtocolError(op, "header", sender, f"could not be read: {type(error).__name__}: {error}") from None
