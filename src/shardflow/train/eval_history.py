"""The chief's evaluations during training, kept in MODEL_DIR/eval/history.jsonl (where the side-car evaluator writes
its own) so that they outlive the chief: a restarted chief, or the same command run again, goes on from them, and
`EarlyStopping` counts its patience over every evaluation of the training, not only those of the last process."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardflow.train.specs import EarlyStopping, EvalSpec

log = logging.getLogger(__name__)


def history_path(model_dir: Path) -> Path:
    return model_dir / "eval" / "history.jsonl"


class EvalHistory:
    """The evaluations of the training that leads to global step `start_step`, in order: those the file holds up
    to that step (later ones belong to a training the job went back from), then each `add`ed."""

    def __init__(self, model_dir: Path, start_step: int) -> None:
        self.path = history_path(model_dir)
        read = _read(self.path)
        self.entries: list[dict[str, Any]] = [e for e in read if e["global_step"] <= start_step]
        if len(self.entries) != len(read):
            self._rewrite()
        self.elapsed_before_s = max((e["elapsed_s"] for e in self.entries if "elapsed_s" in e), default=0.0)
        """The training time of the last evaluation before this chief: its own evaluations' `elapsed_s` go on
        from it (the time between that evaluation and this chief's start is not counted)."""

    def add(self, step: int, elapsed_s: float, metrics: dict[str, float]) -> dict[str, Any]:
        """Record an evaluation at global step `step`, `elapsed_s` into this chief's training; one of the same or a
        later step is replaced: the job went back to an earlier checkpoint (a PS was lost) since."""
        entry = {"global_step": step, "elapsed_s": self.elapsed_before_s + elapsed_s, "metrics": metrics}
        if self.entries and self.entries[-1]["global_step"] >= step:
            self.entries = [e for e in self.entries if e["global_step"] < step]
            self.entries.append(entry)
            self._rewrite()
            return entry
        self.entries.append(entry)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(_line(entry))
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            log.warning("evaluation at global step %d not recorded in %s: %s", step, self.path, error)
        return entry

    def values(self, metric: str) -> list[float]:
        """The metric of each evaluation that computed it (an earlier run of the job may have had other metrics)."""
        return _values(self.entries, metric)

    def _rewrite(self) -> None:
        """The file holds exactly `entries`, replaced at once (a crash leaves the old file or the new one)."""
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(temporary, "w") as f:
                f.writelines(_line(entry) for entry in self.entries)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
        except OSError as error:
            log.warning("evaluations after a restore not dropped from %s: %s", self.path, error)


class SideCarStopping:
    """Early stopping on the side-car evaluator's evaluations, which it appends to the history file one per
    checkpoint: the chief asks `says_stop` now and then, as TensorFlow's early-stopping hooks read the evaluator's
    results back from the model directory. The file is read again only once it changed."""

    def __init__(self, model_dir: Path, stopping: EarlyStopping) -> None:
        self.path, self.stopping = history_path(model_dir), stopping
        self._seen: tuple[int, int] | None = None
        """The file's size and modification time when last read."""

    @classmethod
    def of(cls, model_dir: Path, eval_spec: EvalSpec | None, inline: bool) -> SideCarStopping | None:
        """The chief's, when `eval_spec` asks for early stopping and a side-car evaluator evaluates (the chief
        does not: `inline` False); None otherwise."""
        if eval_spec is None or eval_spec.early_stopping is None or inline:
            return None
        return cls(model_dir, eval_spec.early_stopping)

    def says_stop(self) -> bool:
        """Whether the evaluations so far tell training to end, said in the log when they do. A line still being
        written is left for the next time."""
        try:
            stat = self.path.stat()
        except OSError:
            return False
        if (stat.st_size, stat.st_mtime_ns) == self._seen:
            return False
        self._seen = (stat.st_size, stat.st_mtime_ns)
        metric = self.stopping.metric
        if not self.stopping.should_stop(_values(_read(self.path, polling=True), metric)):
            return False
        log.info("early stopping: the evaluator's %s stopped improving; training ends", metric)
        return True


def _line(entry: dict[str, Any]) -> str:
    # NaN and inf metrics are kept as JSON's extensions (NaN, Infinity), which json reads back.
    return json.dumps(entry) + "\n"


def _values(entries: list[dict[str, Any]], metric: str) -> list[float]:
    return [e["metrics"][metric] for e in entries if metric in e["metrics"]]


def _read(path: Path, polling: bool = False) -> list[dict[str, Any]]:
    """The file's evaluations; a line that is not one (a write cut short by a crash: the last line) is skipped
    and said, naming the file and the line. `polling` (the file is being written): a last line without its end
    is not read yet, and nothing is said (it is said when a chief loads the file)."""
    try:
        lines = path.read_text().split("\n")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as error:
        if not polling:
            log.warning("earlier evaluations not read from %s: %s", path, error)
        return []
    if polling or not lines[-1]:
        lines.pop()  # the end of the last line's newline, or a line still being written
    entries = []
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
            if not _valid(entry):
                raise ValueError("expected global_step, metrics and elapsed_s or checkpoint")
        except ValueError as error:
            if not polling:
                log.warning("%s:%d: not an evaluation, skipped (%s)", path, number, error)
            continue
        entries.append(entry)
    return entries


def _valid(entry: Any) -> bool:
    if not isinstance(entry, dict) or type(entry.get("global_step")) is not int or entry["global_step"] < 0:
        return False
    metrics = entry.get("metrics")
    if not isinstance(metrics, dict) or not all(isinstance(v, int | float) for v in metrics.values()):
        return False
    elapsed = entry.get("elapsed_s")
    return elapsed is None or (isinstance(elapsed, int | float) and math.isfinite(elapsed) and elapsed >= 0)
