"""The headers a PS replies with, typed and checked on receipt; see ps/protocol.py for which request gets which."""

from __future__ import annotations

from typing import Any, ClassVar, Self

from shardflow.ps.embeddings.files import FileRecord
from shardflow.ps.fields import Count, Message


class StepReply(Message, frozen=True):
    """The global step after a request, and whether training is over; what every reply carries."""

    step: Count
    stop: bool
    dropped: bool = False
    """A push that arrived after training ended, not applied."""
    stale: bool = False
    """sync: a push computed on an older version, not applied; the current parameters come with it."""
    nonfinite: Count = 0
    """A push refused because it held NaN or inf (or its worker's loss did), not applied: how many such pushes
    this PS has refused in all, this one included; the current parameters come with it. 0 for any other reply."""
    duplicate: bool = False
    """A push of a worker step this PS already had (a restarted worker repeating it), not applied again; the
    current parameters come with it."""
    lane: bool = False
    """The parameters are in the reply slot the request named (ps/lanes.py), not in frames."""
    rows: Count = 0
    """The last this many frames are the rows of the `Lookup` that rode on the push (`Push.lookup`), one per table."""

    @classmethod
    def decode(cls, header: dict[Any, Any], op: str, sender: str) -> Self:
        """The reply in `header` to the request `op` sent to `sender`; PSProtocolError if it is not one."""
        return cls.from_header(header, op, sender)


class _Answer(Message, frozen=True):
    """The reply to one kind of request."""

    answers: ClassVar[str]
    """The op of that request."""

    @classmethod
    def decode(cls, header: dict[Any, Any], sender: str) -> Self:
        """The reply in `header` from `sender`; PSProtocolError if it is not one."""
        return cls.from_header(header, cls.answers, sender)


class StatusReply(_Answer, frozen=True):
    """A PS's answer to `Status`."""

    answers = "status"

    step: Count
    stop: bool
    initialized: bool
    snapshots: tuple[Count, ...]
    """The steps of the snapshots the chief has not released yet, oldest first."""
    stats: dict[str, int | float]
    """Counters: updates applied, pushes dropped (stale, after max steps), requests malformed or failed, ..."""
    generation: Count = 0
    """How many times this PS was restored after a PS was lost (protocol `Init`): a restarted chief goes on with it."""
    pid: Count = 0
    """The PS's process, as its heartbeat names it: the chief knows which process a restore reached."""
    holding: bool = False
    """The chief sent `Hold` and not yet `Stop` or `SnapshotAt` (ps/admin.py): a chief restarted meanwhile asks for a
    snapshot, which ends it (train/checkpoints/manager.py `adopt`)."""


class RejoinReply(_Answer, frozen=True):
    """A PS's answer to `Rejoin`: what it has of one worker's steps."""

    answers = "rejoin"

    step: Count
    stop: bool
    local_step: Count
    """The last of the worker's steps this PS took (to apply, or refused as non-finite); 0 for none."""
    input_state: dict[str, Any] | None
    """The worker's input position after that step; None for none."""
    done: bool
    """The worker had told this PS it finished."""
    generation: Count
    """How many times the PS were restored after one was lost; the worker's pushes belong to this one."""
    in_sum: bool = False
    """sync: the worker's step `local_step` sits in the sum of the next global step, not applied yet. The worker
    computes its next step on the parameters of that update (a pull for `step + 1`), never on these: a sum takes one
    push of each worker."""


class StateReply(_Answer, frozen=True):
    """A PS's answer to `GetState`; its frames are the parameters (dense buffers, tables), then the slots."""

    answers = "state"

    step: Count
    stop: bool
    state_step: Count
    """The step the state is of: the snapshot's, or the current one."""
    dtypes: tuple[str, ...]
    slots: tuple[dict[str, Count], ...]
    """Per part (dense buffer, then table): optimizer slot key -> index among the slot frames."""
    scalars: tuple[dict[str, float], ...]
    """Per part: scalar optimizer state (e.g. Adam's step count)."""
    iterators: dict[str, Any]
    """By "worker:<index>", its input position after the last of its steps this PS had."""
    worker_steps: dict[str, Count]
    """By "worker:<index>", the last of its steps this PS had."""
    stats: dict[str, int | float]
    table_files: tuple[FileRecord, ...] = ()
    """The files, in the staging directory, holding this PS's rows of the `sf.nn` tables as of `state_step`, in
    replay order (its latest full file of each table, then the increments since)."""
    table_error: str | None = None
    """Why this PS could not write those files (a full disk): the state is no checkpoint."""


class Unserved(Message, frozen=True):
    """What a PS answers, in place of any other reply, to a request it cannot serve yet: it was started or restarted
    and the chief has not initialised (restored) it. Nothing was applied. A worker waits for the chief's restore
    and rejoins; it never fails of it (see ps/connection.py)."""

    unserved: Count
    """The index of the PS, which holds no state yet."""

    @classmethod
    def found_in(cls, header: dict[Any, Any], sender: str) -> Self | None:
        """The answer in `header` if it is one (a check of one key: every reply passes here)."""
        if "unserved" not in header:
            return None
        return cls.from_header(header, "unserved", sender)
