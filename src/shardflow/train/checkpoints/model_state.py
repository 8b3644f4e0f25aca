"""What a checkpoint holds: whole variables, their optimizer slots and the workers' input positions, independent
of how many PS held them and how they were placed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardflow.ps.embeddings.files import FileRecord
from shardflow.ps.protocol import TableRestore


@dataclass
class ModelState:
    """Whole variables, independent of how they were placed: what a checkpoint holds."""

    step: int
    params: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """slot key (e.g. "exp_avg") -> variable name -> tensor shaped like the variable."""
    scalars: dict[str, float] = field(default_factory=dict)
    """Scalar optimizer state shared by all variables (e.g. Adam's "step")."""
    iterators: dict[str, Any] = field(default_factory=dict)
    """Each worker's input position after the last batch whose update is in `params` (ps:0's)."""
    ps_progress: list[dict[str, Any]] = field(default_factory=list)
    """Per PS, what it had of each worker's steps: {"worker_steps": {worker: local step}, "iterators": {worker:
    position after it}}. Async PS apply a worker's step at slightly different moments, so a snapshot at one
    global step may hold a step on one PS and not on another; restored onto as many PS, each PS gets its own,
    and each worker resumes after the last step all PS had, repeating only where some missed it (ps/server.py
    `_repeated`): so a restore applies every record once on every PS."""
    stats: dict[str, Any] = field(default_factory=dict)
    table_files: list[FileRecord] = field(default_factory=list)
    """The files holding the `sf.nn` tables' rows, as every PS wrote them into the staging directory (to save)."""
    table_errors: list[str] = field(default_factory=list)
    """Why some PS could not write their table files: then this state cannot be saved."""
    tables: TableRestore | None = None
    """Where a saved checkpoint keeps the tables' rows (to restore); None: every row starts afresh."""
