"""What `make faults` and `make chaos` share: an audit job's output lines with the moment each arrived, the audit
of its final parameters (which records were applied twice or never), and RELIABILITY.md's generated blocks."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch
from safetensors.torch import load_file

from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.table_rows import CheckpointRows

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "integration" / "jobs" / "audit.py"
NUM_RECORDS, BATCH = 1024, 8


class Lines:
    """Output lines, each with the moment it arrived; several streams may feed one."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.log: IO[str] | None = None
        """Where each line is also written as it arrives, if anywhere."""
        self._lock = threading.Lock()

    def add(self, line: str) -> None:
        with self._lock:
            self.lines.append((time.time(), line.rstrip("\n")))
            if self.log is not None:
                self.log.write(line if line.endswith("\n") else line + "\n")
                self.log.flush()

    def follow(self, stream: IO[str], prefix: str = "") -> threading.Thread:
        """Copies `stream` into the lines, from a thread of its own, until it ends."""

        def read() -> None:
            for line in stream:
                self.add(prefix + line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        return reader

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match[str]] | None:
        for at, line in list(self.lines):
            if at >= after and (found := re.search(pattern, line)):
                return at, found
        return None

    def last(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match[str]] | None:
        found = None
        for at, line in list(self.lines):
            if at >= after and (match := re.search(pattern, line)):
                found = at, match
        return found

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in list(self.lines))


class Run(Lines):
    """One audit job: `python audit.py config.json`, or `prefix` (e.g. `shardflow launch ...`) before audit.py."""

    def __init__(
        self, workdir: Path, config: dict[str, Any], env: dict[str, str], prefix: Sequence[str] = (sys.executable,)
    ) -> None:
        super().__init__()
        path = workdir / "config.json"
        path.write_text(json.dumps(config))
        self.proc = subprocess.Popen(
            [*prefix, str(JOB), str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.proc.stdout is not None
        self._reader = self.follow(self.proc.stdout)

    def wait(self, timeout_s: float = 300) -> int:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


def dynamic_counts(checkpoint: Path, num_records: int) -> torch.Tensor | None:
    """How many times each record was applied as the audit job's dynamic table counts (its "dynamic" option; ids
    hashed as the job hashes them), or None for a job without it."""
    tables = store.load_state(checkpoint)[0].tables
    if tables is None or "seen_hashed" not in tables.chains:
        return None
    ids = (torch.arange(num_records) * 0x9E3779B97F4A7C1 + 12345) & ((1 << 62) - 1)
    rows = CheckpointRows(checkpoint, "seen_hashed", lambda missing: torch.zeros(missing.numel(), 1))
    return rows.lookup(ids).view(-1)


def audit(workdir: Path, mode: str, num_records: int = NUM_RECORDS, batch: int = BATCH) -> tuple[bool, int, int, str]:
    """Whether the result is exact, with the counts of records applied twice (or more) and never."""
    result_path = workdir / "result.json"
    if not result_path.exists():
        return False, 0, 0, "no result"
    result = json.loads(result_path.read_text())
    # A sync step and an all-reduce step average each record's gradient over the 2 workers: it adds 0.5. Under
    # hybrid the dense `seen` is all-reduced, and the PS apply each async push of the dynamic table's rows alone.
    replicas = 2 if mode in ("sync", "allreduce", "hybrid") else 1
    table_replicas = 1 if mode == "hybrid" else replicas
    seen = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))["seen"] * replicas
    dynamic = dynamic_counts(Path(result["checkpoint"]), num_records)
    if dynamic is not None:  # what the dynamic table counts must agree
        seen = torch.where(dynamic * table_replicas == seen, seen, torch.full_like(seen, -1.0))
    applied = seen.round().long()
    twice, never = int((applied >= 2).sum()), int((applied == 0).sum())
    exact_step = result["global_step"] == num_records // batch // replicas
    exact = exact_step and bool(torch.equal(seen, torch.ones_like(seen)))
    why = "" if exact else f"global step {result['global_step']}, {twice} twice, {never} never"
    return exact, twice, never, why


def fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.2f} {unit}".strip()


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are there; None if none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


TITLE = "# Reliability\n"


def write_block(path: Path, name: str, text: str) -> None:
    """Writes `text` into RELIABILITY.md between the markers of the block `name`, in place of what was there, and
    leaves every other block alone; a block not there yet goes at the end."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    old = path.read_text() if path.exists() else TITLE
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(new)
