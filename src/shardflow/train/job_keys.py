"""The job's structured control-plane keys, each declared once with the frozen type of its value: a writer puts
that type and a reader gets it back validated, or an error naming the key and its writer (cluster/control_keys.py
`Key`). Declared here, not in cluster/, because the placement's type lives in ps/, which `cluster` never imports;
the plain text keys stay in cluster/control_keys.py.

Each entry reads `key`: writer -> readers. Meaning.

- `restore/iterators`: chief, when it restored a checkpoint -> workers. Each worker's input position.
- `placement`: chief -> workers. Which PS holds which piece of which variable.
- `recovery`: chief, when it restored every PS after one was lost (or a restarted chief raised the generation) ->
  workers. A worker whose generation is older drops what it was doing and rejoins.
- `progress/<role>`: each worker, about once a second -> chief. Its last one says it is done.
- `handover/<role>`: chief -> that worker. The workers lost for good (not back within worker_rejoin_timeout_s)
  whose remaining shards it reads once its own is done, as each of them (their worker index and step count):
  every record is still applied once (async mode with epochs; see chief_loop.py).
- `capture/current`: chief -> every role. The capture being recorded.
- `capture/request`: `shardflow profile capture` -> chief. A capture asked for from outside the job.
- `eval/final`: evaluator -> chief. The side-car evaluator's last checkpoint and metrics.

`sf.AllReduceStrategy` (train/allreduce_chief.py, allreduce_worker.py):

- `global_step`: chief, about once a second -> `shardflow profile capture`. The job's global step as the workers'
  progress reports last told it (a PS job's is ps:0's; a hybrid job's PS count their tables' updates instead).
- `allreduce/start`: chief -> workers. The global step training starts from, and the checkpoint in model_dir each
  worker loads itself (every process shares model_dir); none: the model's initial values.
- `allreduce/checkpoint/<n>`: worker:0 -> chief. The n-th state to checkpoint or evaluate (from 1): its global
  step, its chunks (`state/checkpoint/<n>/<i>`: put before it where they fit allreduce_state.WINDOW, else streamed
  after it), whether it is the last of training, its sender's process; the chief saves or evaluates it, then
  deletes them.
- `allreduce/checkpoint/<n>/position/<role>`: each worker -> chief. Its input position after that step's batch.
- `allreduce/checkpoint/<n>/saved`: chief -> worker:0. Checkpoint n is handled; worker:0 sends checkpoint n+1 only
  after it (so at most one state is on the control plane at a time), and ends after the last one's.
- `allreduce/resume/<role>`: that worker -> itself restarted. Its input position at its last hand-over, and how
  many of its batches had been applied then.
- `allreduce/live/<role>`: that worker -> chief, and the other workers. Whether it trains in a formed group, its
  generation, and (worker:0) the first hand-over the chief has not confirmed saved. Put at the worker's start, and
  again with everything else a restarted chief needs once the worker finds a new chief's id
  (train/allreduce_replay.py): a restarted chief adopts a live group from it rather than restore a checkpoint over
  it.

`sf.HybridStrategy` (train/hybrid_chief.py, hybrid_worker.py) adds:

- `hybrid/snapshot/<g>/<n>`: worker:0 -> the other workers and the chief. The step of every PS's snapshot of the
  `sf.nn` tables taken for state n (in PS recovery generation g), while no worker pushed past it; the others push
  again only once it is set, and the chief saves its rows with state n.
- `hybrid/recovery`: chief -> workers, when a PS was lost. Its generation: every worker stops where it is and says
  so in `hybrid/stopped/<g>/<role>` (a plain key); once all did, the chief restores every PS from the latest
  checkpoint and puts `hybrid/restart/<g>`: that checkpoint (each worker loads it from model_dir), each worker's
  input position in it, and the number of the next hand-over.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shardflow.cluster.control_keys import Key
from shardflow.profile.capture import check_capture_name, check_steps
from shardflow.ps.placement import Placement


class _Value(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A value on the control plane: read back only with exactly its fields."""


class RecoveryNotice(_Value, frozen=True, kw_only=True):
    generation: int
    """How many times the PS of this job were restored after one was lost, so far."""
    step: int
    """The global step every PS was restored to."""
    lost: str
    """The role whose loss caused it (`ps:1`), or `chief` when a restarted chief publishes the generation again."""


class ProgressReport(_Value, frozen=True, kw_only=True):
    local_step: int
    """This worker's own step count (it goes on across restarts)."""
    epoch: int
    first_loss: float | None
    loss: float
    """The loss of its latest step (NaN or inf when that step's was)."""
    steps_per_s: float
    input_wait_share: float
    """The share of its time spent waiting for its input."""
    time: float
    """When it was sent (time.time())."""
    done: bool
    generation: int
    """The recovery generation this run of the worker belongs to: the chief counts a `done` of the current one."""
    summary_losses: dict[int, tuple[float, int]]
    """Loss sum and count per summary interval of global steps that the chief has maybe not written yet."""
    summary_interval: int
    """The interval of its latest step; it adds to no earlier one."""


class Handover(_Value, frozen=True, kw_only=True):
    workers: tuple[str, ...]
    """The lost workers whose shards the reader finishes, as each of them."""


class RestoredPositions(_Value, frozen=True, kw_only=True):
    positions: dict[str, dict[str, Any]]
    """Each worker's input position in the restored checkpoint, by role name."""


class Capture(_Value, frozen=True, kw_only=True):
    """The global steps [first, last) of a capture on every role, and whether it records torch ops."""

    name: str
    first: int
    last: int
    ops: bool = False

    def __post_init__(self) -> None:
        check_capture_name(self.name)
        check_steps((self.first, self.last), what="the capture's steps")


class EvaluationResult(_Value, frozen=True, kw_only=True):
    checkpoint: str | None = None
    """The last checkpoint evaluated; None when the evaluator evaluated none."""
    metrics: dict[str, float]


class GlobalStep(_Value, frozen=True, kw_only=True):
    step: int
    """The global step the job is at (or a second or two behind it)."""


class AllReduceStart(_Value, frozen=True, kw_only=True):
    step: int
    """The global step training starts from."""
    checkpoint: str | None
    """The restored checkpoint's directory name in model_dir's checkpoints; None: the model's initial values."""


class StateNotice(_Value, frozen=True, kw_only=True):
    step: int
    """The global step of the state."""
    num_chunks: int
    scalars: dict[str, float]
    """Its scalar optimizer state (train/checkpoints/model_state.py)."""
    checkpoint: bool
    """Saved as a checkpoint; else only evaluated (at a multiple of EvalSpec.every_n_steps)."""
    final: bool
    """The last state of training: the chief saves it, evaluates it and ends the job."""
    sender: int
    """worker:0's process id, as its heartbeat names it: a beat from another one while the chief waits for a chunk
    says the sender was lost."""
    evaluate: bool = False
    """Evaluated by the chief, as EvalSpec.every_n_secs asked (by worker:0's clock)."""


class InputState(_Value, frozen=True, kw_only=True):
    position: dict[str, Any]
    """A worker's input position (train/input.py InputPosition.get_state())."""


class ResumePoint(_Value, frozen=True, kw_only=True):
    position: dict[str, Any]
    """A worker's input position (train/input.py InputPosition.get_state())."""
    batches_applied: int
    """How many of its batches the global steps up to then applied."""


class RejoinState(_Value, frozen=True, kw_only=True):
    """Where a re-formed group goes on: the first survivor's, broadcast with its state to the restarted workers
    (train/allreduce_group.py `rejoin`)."""

    step: int
    """The global step the re-formed group goes on from."""
    scalars: dict[str, float]
    """Its scalar optimizer state (train/checkpoints/model_state.py)."""
    hand_overs: int
    """How many states worker:0 handed the chief so far."""
    hand_over_step: int
    """The global step of the last of them (-1: none)."""
    hand_over_saves: bool
    """Whether the last of them is a checkpoint (else only evaluated)."""
    batches_applied: list[int]
    """Per worker index: how many of its batches the global steps so far applied."""
    had_batch: list[bool]
    """Per worker index: whether it had a batch in the last global step (its input is done otherwise)."""


class TablesSnapshot(_Value, frozen=True, kw_only=True):
    step: int
    """The PS's own count of table updates at the snapshot (each PS has the same: every push goes to each)."""


class HybridRecovery(_Value, frozen=True, kw_only=True):
    generation: int
    """How many times the PS of this hybrid job were restored after one was lost, this time included."""
    lost: str
    """The PS whose loss caused it, or "every worker" (lost at once, with the dense state)."""


class HybridRestart(_Value, frozen=True, kw_only=True):
    step: int
    """The global step of the checkpoint every PS was restored to."""
    checkpoint: str | None
    """That checkpoint's directory name in model_dir's checkpoints, which every worker loads; None: none was saved,
    and the job goes back to the model's initial values."""
    positions: dict[str, dict[str, Any]]
    """Each worker's input position in it, by role name; none: the position the job started from."""
    next_hand_over: int
    """The number of the next state worker:0 hands the chief."""


class LiveWorker(_Value, frozen=True, kw_only=True):
    joined: bool
    """Whether the worker trained in a formed group (else it waits for the job's start)."""
    generation: int
    """The generation of the group it trains in, or forms (`forming`); -1: none yet."""
    forming: bool
    """Whether it forms that generation (a worker restarted meanwhile joins it) or trains in it (then the next)."""
    next_hand_over: int
    """worker:0's first hand-over the chief has not confirmed saved (its state is kept and put again)."""
    step: int
    """worker:0's global step when it last looked (-1: not known); for the chief's log."""
    chief: str
    """The chief's id (control_keys.ALLREDUCE_CHIEF) for which the worker put everything: the chief reads no
    other."""


class Saved(_Value, frozen=True, kw_only=True):
    path: str | None
    """The checkpoint written; None where it could not be (a periodic one, training goes on)."""


PLACEMENT = Key("placement", Placement, "the chief")
RESTORE_ITERATORS = Key("restore/iterators", RestoredPositions, "the chief")
RECOVERY = Key("recovery", RecoveryNotice, "the chief")
CAPTURE_CURRENT = Key("capture/current", Capture, "the chief")
CAPTURE_REQUEST = Key("capture/request", Capture, "a `shardflow profile capture` of this job")
EVAL_FINAL = Key("eval/final", EvaluationResult, "the evaluator")


def progress(role: str) -> Key[ProgressReport]:
    return Key(f"progress/{role}", ProgressReport, role)


def handover(role: str) -> Key[Handover]:
    return Key(f"handover/{role}", Handover, "the chief")


GLOBAL_STEP = Key("allreduce/global_step", GlobalStep, "the chief")
ALLREDUCE_START = Key("allreduce/start", AllReduceStart, "the chief")


def allreduce_checkpoint(n: int) -> Key[StateNotice]:
    return Key(f"allreduce/checkpoint/{n}", StateNotice, "worker:0")


def allreduce_position(n: int, role: str) -> Key[InputState]:
    return Key(f"allreduce/checkpoint/{n}/position/{role}", InputState, role)


def allreduce_saved(n: int) -> Key[Saved]:
    return Key(f"allreduce/checkpoint/{n}/saved", Saved, "the chief")


def allreduce_resume(role: str) -> Key[ResumePoint]:
    return Key(f"allreduce/resume/{role}", ResumePoint, role)


def hybrid_snapshot(generation: int, n: int) -> Key[TablesSnapshot]:
    return Key(f"hybrid/snapshot/{generation}/{n}", TablesSnapshot, "worker:0")


HYBRID_RECOVERY = Key("hybrid/recovery", HybridRecovery, "the chief")


def hybrid_restart(generation: int) -> Key[HybridRestart]:
    return Key(f"hybrid/restart/{generation}", HybridRestart, "the chief")


def hybrid_stopped(generation: int, role: str) -> str:
    return f"hybrid/stopped/{generation}/{role}"


def hybrid_workers_lost(generation: int) -> str:
    """Set by a restarted worker that found no other survived recovery `generation`: the chief restores every PS."""
    return f"hybrid/workers_lost/{generation}"


def allreduce_live(role: str) -> Key[LiveWorker]:
    return Key(f"allreduce/live/{role}", LiveWorker, role)
