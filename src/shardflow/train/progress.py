"""What the chief shows while training: a live table in a terminal, a line every few seconds in a log."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from shardflow import env
from shardflow.train.job_keys import ProgressReport

_LOG_EVERY_S = 10.0


class ProgressDisplay:
    """Global step, epoch, loss, steps/s per worker and an ETA."""

    def __init__(self, max_steps: int | None, epochs: int | None, start_step: int) -> None:
        self.max_steps = max_steps
        self.epochs = epochs
        self.start_step = start_step
        self.started = time.monotonic()
        self.last_logged = 0.0
        self.console = Console(file=sys.stdout)
        self.live: Live | None = None
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def _eta(self, step: int, epoch: float | None) -> str:
        elapsed = time.monotonic() - self.started
        if self.max_steps and step > self.start_step:
            fraction = (step - self.start_step) / max(self.max_steps - self.start_step, 1)
        elif self.epochs and epoch:
            fraction = epoch / self.epochs
        else:
            return "?"
        return f"{elapsed / fraction - elapsed:.0f}s" if 0 < fraction < 1 else "0s"

    def update(self, step: int, progress: dict[str, ProgressReport]) -> None:
        # A worker's first loss is set by its first step of this run: one restored after a finished job has none.
        running = [p for p in progress.values() if p.first_loss is not None]
        if not running:
            return  # no worker has made a step yet (or has any to make): nothing to show
        loss = sum(p.loss for p in running) / len(running)
        epochs = [p.epoch for p in running]
        epoch = min(epochs) if epochs else None
        rate = (step - self.start_step) / max(time.monotonic() - self.started, 1e-9)
        if self.live is not None:
            eta = self._eta(step, epoch)
            table = Table(title=f"global step {step}  epoch {epoch}  loss {loss:.4f}  {rate:.0f} steps/s  ETA {eta}")
            for column in ("role", "local steps", "steps/s", "loss", "input wait"):
                table.add_column(column, justify="right")
            for name, p in sorted(progress.items()):
                table.add_row(
                    name,
                    str(p.local_step),
                    f"{p.steps_per_s:.1f}",
                    f"{p.loss:.4f}",
                    f"{p.input_wait_share:.0%}",
                )
            self.live.update(table)
        elif time.monotonic() - self.last_logged >= _LOG_EVERY_S:
            self.last_logged = time.monotonic()
            per_worker = ", ".join(f"{n} {p.steps_per_s:.0f}/s" for n, p in sorted(progress.items()))
            print(
                f"{chief_prefix()}global step {step}, epoch {epoch}, loss {loss:.4f}, {rate:.0f} global steps/s "
                f"({per_worker}), ETA {self._eta(step, epoch)}",
                flush=True,
            )

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def chief_prefix() -> str:
    """`[chief] ` before what the chief prints, as the launcher puts the role's name before every other role's
    lines; nothing where a launcher (`shardflow launch`) already does so for the chief too."""
    return "" if env.get(env.CLUSTER) else "[chief] "
