"""When, what and where the chief checkpoints while a job runs: at exact multiples of save_checkpoints_steps, or
every save_checkpoints_secs at the furthest PS's step (asked for once every PS holds its pushes), and once more when
training ends (preempted or not); of the whole model state the PS snapshot at that step; into model_dir, through the
store."""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardflow.profile import spans
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.servers import fetch_state

if TYPE_CHECKING:
    from shardflow.profile.recorder import SpanRecorder
    from shardflow.ps.admin import PSAdmin, StatusReply
    from shardflow.ps.embeddings.spec import TableSpec
    from shardflow.ps.placement import Placement
    from shardflow.train.job import JobConfig
    from shardflow.train.role_context import RoleContext

log = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """A checkpoint the job needs could not be written (the final one, or any with `fail_on_save_error`); the
    message names the step, the directory and the cause (a full or read-only disk, a permission)."""


def snapshot_every(job: JobConfig, role: RoleContext) -> int | None:
    """The PS snapshot at every step that is a checkpoint or an inline evaluation."""
    eval_spec = job.eval_spec
    every_eval = eval_spec.every_n_steps if eval_spec is not None and not role.spec.num("evaluator") else None
    counts = [n for n in (job.save_checkpoints_steps, every_eval) if n]
    return math.gcd(*counts) if counts else None


class CheckpointManager:
    """The chief's checkpoints of one run, from the PS's snapshots (ps/state.py `Snapshots`).

    Every PS snapshots its state at the steps `snapshot_every` gives it and at a step the chief asks for; the chief
    saves the ones that are checkpoints, oldest first, and then lets the PS drop them. The state restored after a PS
    was lost (restore.py) is the latest checkpoint this writes."""

    def __init__(
        self,
        job: JobConfig,
        role: RoleContext,
        client: PSAdmin,
        placement: Placement,
        recorder: SpanRecorder,
        start_step: int,
        table_specs: Sequence[TableSpec] = (),
    ) -> None:
        """`table_specs`: the model's `sf.nn` tables, whose rows the PS write into each checkpoint."""
        self.client = client
        self.table_specs = table_specs
        self.recorder = recorder
        self.model_dir = job.model_dir
        self.keep = job.keep_checkpoint_max
        self.fail_on_save_error = job.strategy.fail_on_save_error
        self.num_failed_saves = 0
        """Periodic checkpoints that could not be written while training went on (TrainResult's)."""
        self.every_n_steps = job.save_checkpoints_steps
        self.every_n_secs = None if job.save_checkpoints_steps else job.save_checkpoints_secs
        """Time-based checkpoints only where no step count is given."""
        self.manifest: dict[str, Any] = {
            "placement": placement.to_json(),
            "mode": job.strategy.mode,
            "num_workers": role.num_workers,
            "num_ps": role.num_ps,
            "optimizer": job.optimizer.to_json(),
        }
        """What every checkpoint of this run records besides the state (the store adds the step and the files)."""
        self.last_snapshot_step = start_step
        """The newest snapshot handled: those after it are saved (if checkpoints) and evaluated next."""
        self.requested_snapshot: int | None = None
        """The step asked for (`request_snapshot`) to checkpoint."""
        self.pending_snapshot: int | None = None
        """The step asked for last, for a checkpoint or an evaluation."""
        self.last_checkpoint_time = time.monotonic()

    def adopt(self, replies: Sequence[StatusReply]) -> None:
        """A restarted chief over live PS: the snapshots they took for the chief that died and that are newer than
        the latest checkpoint are saved next, oldest first; without any, one is asked for at once: what a PS lost
        from now on is restored to. So too where the chief died between its `Hold` and what follows: that ends it."""
        self.last_snapshot_step = store.latest_step(self.model_dir)
        if not any(reply.snapshots for reply in replies) or any(reply.holding for reply in replies):
            self.request_snapshot()

    def poll(self, replies: Sequence[StatusReply], evaluate: Callable[[ModelState], None]) -> None:
        """On each status poll of the PS: save their snapshots (`save_snapshots`); with none to save, ask for one
        once a time-based checkpoint is due."""
        if self.save_snapshots(replies, evaluate):
            return
        if self.every_n_secs is not None and time.monotonic() - self.last_checkpoint_time >= self.every_n_secs:
            self.request_snapshot()

    def save_snapshots(self, replies: Sequence[StatusReply], evaluate: Callable[[ModelState], None]) -> bool:
        """Checkpoint, oldest first, every snapshot all PS hold that is not handled yet, and hand each to `evaluate`
        (which evaluates those at its own step counts): so both happen at exact multiples of their step counts,
        however late the chief looks. Then the PS drop them. Whether there was any."""
        common = set.intersection(*(set(reply.snapshots) for reply in replies))
        ready = sorted(step for step in common if step > self.last_snapshot_step)
        for step in ready:
            state = fetch_state(self.client, step)
            if (self.every_n_steps and step % self.every_n_steps == 0) or step == self.requested_snapshot:
                self.save(state)
            evaluate(state)
            self.last_snapshot_step = step
        if ready:
            self.client.release_snapshots(ready[-1])
        return bool(ready)

    def request_snapshot(self, checkpoint: bool = True) -> int:
        """Every PS snapshots one step, the furthest PS's now (PSAdmin.snapshot_at_furthest), or the step asked for
        already while not every PS has taken it (a PS waits for one such step: asking for another before would
        leave a snapshot on some PS only, and their table files' chains apart). It is then checkpointed if
        `checkpoint` (else only handed to `evaluate`, see `save_snapshots`). That step."""
        target = self.pending_snapshot
        if target is None or target <= self.last_snapshot_step:
            target = self.client.snapshot_at_furthest()
            self.pending_snapshot = target
        if checkpoint:
            self.requested_snapshot = target
            self.last_checkpoint_time = time.monotonic()
        return target

    def restored(self, step: int) -> None:
        """Every PS was restored to `step` (restore.py `Recovery`): the snapshots they held, asked for or not, are
        gone."""
        self.last_snapshot_step = step
        self.requested_snapshot = self.pending_snapshot = None

    def save(self, state: ModelState) -> Path | None:
        """A periodic checkpoint, and where it was written. One that cannot be written (a full or read-only disk)
        leaves none behind and `latest` as it was: it is logged and counted, training goes on and the next interval
        saves again; None. With `fail_on_save_error` the job fails instead (CheckpointSaveError)."""
        try:
            with self.recorder.span(spans.CHECKPOINT, state.step):
                path = store.save_state(self.model_dir, state, self.manifest, self.keep, self.table_specs)
        except OSError as error:
            if self.fail_on_save_error:
                raise self._error(state.step, error, "fail_on_save_error=True ends the job") from None
            self.num_failed_saves += 1
            latest = store.latest(self.model_dir)
            log.warning(
                "checkpoint at global step %d not saved in %s: %s; training goes on, retrying at the next interval "
                "(%d failed so far; %s)",
                state.step,
                store.directory(self.model_dir),
                _cause(error),
                self.num_failed_saves,
                f"the latest saved is {latest.name}" if latest else "none saved yet",
            )
            return None
        self.last_checkpoint_time = time.monotonic()
        return path

    def save_final(self, preempted: bool) -> tuple[ModelState, Path]:
        """The checkpoint at the end of training, of the state every PS holds now with their counters; the next run
        resumes from it. The state, and where it was written. Raises CheckpointSaveError where it cannot be
        written."""
        state = fetch_state(self.client)
        try:
            manifest = {**self.manifest, "ps_stats": state.stats}
            path = store.save_state(self.model_dir, state, manifest, self.keep, self.table_specs)
        except OSError as error:
            latest = store.latest(self.model_dir)
            resume = f"a re-run resumes from {latest}" if latest else "a re-run starts afresh: no checkpoint was saved"
            raise self._error(state.step, error, f"it is the final checkpoint: {resume}") from None
        if preempted:
            log.warning("preempted: checkpoint %s at global step %d; the next run resumes from it", path, state.step)
        return state, path

    def _error(self, step: int, error: OSError, why: str) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"checkpoint at global step {step} could not be saved in {store.directory(self.model_dir)}: "
            f"{_cause(error)}; {why}"
        )


def _cause(error: OSError) -> str:
    """The error as "No space left on device (ENOSPC)", without the name of the temporary file it was writing."""
    name = errno.errorcode.get(error.errno) if error.errno is not None else None
    return f"{error.strerror} ({name})" if error.strerror and name else str(error)
