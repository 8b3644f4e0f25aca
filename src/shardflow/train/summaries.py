"""TensorBoard event files written by the chief: loss, metrics, throughput, input wait and PS apply time."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

from shardflow.data import TFRecordWriter
from shardflow.ps.embeddings.shards import TABLE_STATS
from shardflow.train.job_keys import ProgressReport

log = logging.getLogger(__name__)


class EventWriter:
    """One TensorBoard event file: TFRecords of Event protos. Written directly, because importing
    torch.utils.tensorboard also imports TensorFlow when it is installed, which costs seconds per job."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.shardflow"
        self._path = directory / name
        self._writer = TFRecordWriter(str(self._path))
        self._failed = False
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: Event) -> None:
        self._guard(self._writer.write, event.SerializeToString())

    def _guard(self, action: Callable[..., None], *args: bytes) -> None:
        """A full or read-only disk loses summaries, never the job: the first failure is logged, and every write
        after it tried again."""
        try:
            action(*args)
        except OSError as error:
            if not self._failed:
                log.warning("TensorBoard summaries not written to %s: %s; training goes on", self._path, error)
            self._failed = True

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._write(Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._guard(self._writer.flush)

    def close(self) -> None:
        self._guard(self._writer.close)


class Summaries:
    """Scalars under model_dir/tensorboard (train) and model_dir/tensorboard/eval.

    Training scalars come every `save_summary_steps` global steps and at the last: the loss at global step s is
    the mean over all workers of the losses of the batches computed on the parameters of global steps
    [s - save_summary_steps, s), written once every worker is past that interval; the rates (steps/s, input wait,
    PS apply time) and the learning rate at the global step where the chief sees a multiple passed."""

    def __init__(
        self,
        model_dir: Path,
        *,
        save_summary_steps: int = 100,
        workers: Sequence[str] = (),
        learning_rate: Callable[[int], float] | None = None,
    ) -> None:
        self.directory = model_dir / "tensorboard"
        self.train = EventWriter(self.directory)
        self.eval = EventWriter(self.directory / "eval")
        self.every = save_summary_steps
        self.workers = list(workers)
        self.learning_rate = learning_rate
        self._last: tuple[float, int] | None = None
        self._last_apply: dict[str, tuple[float, float]] = {}
        self._next_rates_step: int | None = None
        # Per summary interval not written yet, per worker: its loss sum and count in that interval.
        self._losses: dict[int, dict[str, tuple[float, int]]] = {}
        self._written_interval = -1

    def training(
        self,
        step: int,
        progress: dict[str, ProgressReport],
        ps_stats: list[dict[str, Any]],
        *,
        final: bool = False,
    ) -> None:
        """Write what is due at global step `step`; `final`: training is over at `step`, write everything."""
        self._write_losses(step, progress, final)
        if self._next_rates_step is None:
            self._next_rates_step = (step // self.every + 1) * self.every
        if final or step >= self._next_rates_step:
            self._next_rates_step = (step // self.every + 1) * self.every
            self._write_rates(step, progress, ps_stats)
        self.train.flush()

    def _write_losses(self, step: int, progress: dict[str, ProgressReport], final: bool) -> None:
        for name, p in progress.items():
            for interval, (total, count) in p.summary_losses.items():
                if interval > self._written_interval:
                    self._losses.setdefault(interval, {})[name] = (total, count)
        # A worker adds to no interval before its latest; one that is done adds to none.
        workers = self.workers or list(progress)
        passed = [progress[w].summary_interval if not progress[w].done else None for w in workers if w in progress]
        complete = min([i for i in passed if i is not None], default=None) if len(passed) == len(workers) else -1
        for interval in sorted(self._losses):
            end = (interval + 1) * self.every
            if interval * self.every >= step and final:
                break  # batches of updates dropped after the last step
            if not final and (end > step or (complete is not None and interval >= complete)):
                break
            by_worker = self._losses.pop(interval).values()
            count = sum(c for _, c in by_worker)
            if count:
                self.train.add_scalar("loss", sum(t for t, _ in by_worker) / count, min(end, step))
            self._written_interval = interval

    def _write_rates(self, step: int, progress: dict[str, ProgressReport], ps_stats: list[dict[str, Any]]) -> None:
        # Only workers that made a step in this run (a first loss): one restored after its input ended has no rate.
        running = {name: p for name, p in progress.items() if p.first_loss is not None}
        if not running:
            return  # nothing trained yet, or nothing left to train: no point of 0
        now = time.monotonic()
        share = sum(p.input_wait_share for p in running.values()) / len(running)
        self.train.add_scalar("input_wait_share", share, step)
        for name, p in running.items():
            self.train.add_scalar(f"steps_per_sec/{name}", p.steps_per_s, step)
        if self._last is not None and now > self._last[0]:
            self.train.add_scalar("global_step/sec", (step - self._last[1]) / (now - self._last[0]), step)
        self._last = (now, step)
        if self.learning_rate is not None:
            self.train.add_scalar("learning_rate", self.learning_rate(step), step)
        for k, stats in enumerate(ps_stats):
            applied, apply_s = float(stats.get("applied", 0)), float(stats.get("apply_s", 0.0))
            previous = self._last_apply.get(f"ps:{k}")
            if previous is not None and applied > previous[0]:
                self.train.add_scalar(
                    f"ps_apply_ms/ps:{k}", 1000 * (apply_s - previous[1]) / (applied - previous[0]), step
                )
            self._last_apply[f"ps:{k}"] = (applied, apply_s)
        self._write_tables(step, ps_stats)

    def _write_tables(self, step: int, ps_stats: list[dict[str, Any]]) -> None:
        """Each `sf.nn` table's counters, summed over the PS: rows held, admitted, rejected, evicted, expired,
        bytes (tags `tables/<table>/<counter>`)."""
        totals: dict[str, float] = {}
        for stats in ps_stats:
            for key, value in stats.items():
                if key.startswith(TABLE_STATS):
                    totals[key] = totals.get(key, 0.0) + float(value)
        for key, value in totals.items():
            self.train.add_scalar("tables/" + key[len(TABLE_STATS) :], value, step)

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.eval.add_scalar(name, value, step)
        self.eval.flush()

    def close(self) -> None:
        self.train.close()
        self.eval.close()
