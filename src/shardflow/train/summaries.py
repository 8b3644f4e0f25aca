"""TensorBoard event files written by the chief: loss, metrics, throughput, input wait and PS apply time."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

from shardflow.data import TFRecordWriter


class EventWriter:
    """One TensorBoard event file: TFRecords of Event protos. Written directly, because importing
    torch.utils.tensorboard also imports TensorFlow when it is installed, which costs seconds per job."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.shardflow"
        self._writer = TFRecordWriter(str(directory / name))
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: Event) -> None:
        self._writer.write(event.SerializeToString())

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._write(Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Summaries:
    """Scalars under model_dir/tensorboard (train) and model_dir/tensorboard/eval."""

    def __init__(self, model_dir: Path) -> None:
        self.directory = model_dir / "tensorboard"
        self.train = EventWriter(self.directory)
        self.eval = EventWriter(self.directory / "eval")
        self._last: tuple[float, int] | None = None
        self._last_apply: dict[str, tuple[float, float]] = {}

    def training(self, step: int, progress: dict[str, dict[str, Any]], ps_stats: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        running = [p for p in progress.values() if p.get("local_step")]
        if running:
            self.train.add_scalar("loss", sum(p["loss"] for p in running) / len(running), step)
            share = sum(p.get("input_wait_share", 0.0) for p in running) / len(running)
            self.train.add_scalar("input_wait_share", share, step)
        for name, p in progress.items():
            self.train.add_scalar(f"steps_per_sec/{name}", p["steps_per_s"], step)
        if self._last is not None and now > self._last[0]:
            self.train.add_scalar("global_step/sec", (step - self._last[1]) / (now - self._last[0]), step)
        self._last = (now, step)
        self.train.flush()
        for k, stats in enumerate(ps_stats):
            applied, apply_s = float(stats.get("applied", 0)), float(stats.get("apply_s", 0.0))
            previous = self._last_apply.get(f"ps:{k}")
            if previous is not None and applied > previous[0]:
                self.train.add_scalar(
                    f"ps_apply_ms/ps:{k}", 1000 * (apply_s - previous[1]) / (applied - previous[0]), step
                )
            self._last_apply[f"ps:{k}"] = (applied, apply_s)

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.eval.add_scalar(name, value, step)
        self.eval.flush()

    def close(self) -> None:
        self.train.close()
        self.eval.close()
