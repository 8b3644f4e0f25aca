"""The parameter server: holds this PS's shards in flat buffers and row-sparse tables, applies pushed gradients,
counts the global step."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from shardflow.comm.server import Request, Server
from shardflow.profile.recorder import flow_id, get_recorder
from shardflow.ps.apply import ApplyConfig
from shardflow.ps.optimizers import OptimizerSpec
from shardflow.ps.sparse import RowGrad, check_row_grad, check_rows, row_gradient
from shardflow.ps.state import Part, ShardState, capture, load_slots

log = logging.getLogger(__name__)

# Snapshots the chief has not saved yet; at this many the PS stops applying pushes until it catches up, so
# every checkpoint and evaluation happens at its exact step, as TF's synchronous checkpoint hooks do.
_MAX_SNAPSHOTS = 4


class ParameterServer:
    """Serves one PS's variables. Single-threaded: requests are handled in arrival order, replies may be deferred."""

    def __init__(self, server: Server, index: int) -> None:
        self.server = server
        self.index = index
        self.config = ApplyConfig()
        self.dtypes: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        # Row-sparse pieces (embedding tables), each a tensor of its own, read and updated a few rows at a time.
        self.tables: list[torch.nn.Parameter] = []
        self.table_optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        self.initialized = False
        self.active: set[int] = set()
        self.clocks: dict[int, int] = {}
        self.stats: dict[str, float] = {"applied": 0, "dropped_stale": 0, "dropped_after_max_steps": 0, "apply_s": 0.0}
        # sync: gradients of the current version, summed, and the pushes waiting for that version's update.
        self._accumulated: list[torch.Tensor] = []
        self._accumulated_rows: list[list[RowGrad]] = []
        self._num_accumulated = 0
        self._waiting_for_update: list[Request] = []
        # ssp: pushes whose reply is held until the slowest worker catches up; (request, clock it needs).
        self._held: list[tuple[Request, int]] = []
        # sync: pulls waiting for a version that has not been applied yet; (request, min_step).
        self._pulls: list[tuple[Request, int]] = []
        self._snapshot: list[torch.Tensor] | None = None
        # Checkpoint snapshots taken at exact steps, until the chief saved them; ps:0 also tracks input positions.
        self.snapshots: dict[int, ShardState] = {}
        self.snapshot_at: int | None = None
        self.iterators: dict[str, Any] = {}
        self._deferred_pushes: list[Request] = []
        self._shutdown = False
        self._handlers: dict[str, Callable[[Request], None]] = {
            "init": self._on_init,
            "pull": self._on_pull,
            "rows": self._on_rows,
            "push": self._on_push,
            "done": self._on_done,
            "step": self._on_step,
            "state": self._on_state,
            "snapshot_at": self._on_snapshot_at,
            "stop": self._on_stop,
            "release_snapshots": self._on_release_snapshots,
            "shutdown": self._on_shutdown,
        }

    # -- loop ---------------------------------------------------------------------------------

    def serve(
        self,
        should_stop: Callable[[], bool] = lambda: False,
        poll_s: float = 0.5,
        periodic: Callable[[int], None] | None = None,
    ) -> None:
        """Handle requests until a shutdown request arrives or `should_stop()` says the job is over;
        `periodic(global_step)` runs about every `poll_s` seconds, busy or idle."""
        next_periodic = time.monotonic() + poll_s
        while not self._shutdown:
            request = self.server.recv(timeout_s=poll_s)
            if periodic is not None and time.monotonic() >= next_periodic:
                next_periodic = time.monotonic() + poll_s
                periodic(self.step)
            if request is None:
                if should_stop():
                    return
                continue
            if request.op == "push" and len(self.snapshots) >= _MAX_SNAPSHOTS:
                self._deferred_pushes.append(request)
                continue
            handler = self._handlers.get(request.op)
            if handler is None:
                self.server.reply_error(request, f"ps:{self.index} does not know the request {request.op!r}")
                continue
            if not self.initialized and request.op not in ("init", "step", "shutdown"):
                self.server.reply_error(
                    request, f"ps:{self.index} is not initialised yet; the chief sends 'init' first"
                )
                continue
            try:
                handler(request)
            except (ValueError, KeyError, RuntimeError) as error:
                log.exception("ps:%d failed on %r from %s", self.index, request.op, request.sender)
                self.server.reply_error(request, f"ps:{self.index} failed on {request.op!r}: {error}")

    # -- state --------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def _header(self, **extra: Any) -> dict[str, Any]:
        return {"step": self.step, "stop": self.finished, **extra}

    def _params_snapshot(self) -> list[torch.Tensor]:
        # Replies go out zero-copy while the next update changes the buffers in place, so they carry a copy,
        # made once per version and shared by every reply of that version.
        if self._snapshot is None:
            self._snapshot = [p.detach().clone() for p in self.params]
        return self._snapshot

    def _reply_params(self, request: Request, **extra: Any) -> None:
        started = time.perf_counter_ns()
        self.server.reply(request, self._header(**extra), self._params_snapshot())
        if (recorder := get_recorder()) is not None:
            recorder.end("reply", self.step - 1, started, int(request.header.get("w", -1)))

    def _parts(self) -> list[Part]:
        """Every tensor this PS holds with the optimizer that updates it: the dtype buffers, then the tables."""
        return [(p, self.optimizer) for p in self.params] + [(t, self.table_optimizer) for t in self.tables]

    def _apply(self, grads: list[torch.Tensor], row_grads: list[list[RowGrad]], requests: list[Request]) -> None:
        """One update: the mean of the dense gradients and of the row-sparse ones of `len(requests)` pushes."""
        started = time.perf_counter_ns()
        recorder = get_recorder()
        if recorder is not None:
            for request in requests:
                recorder.flow("apply", self.step, flow_id(request.sender, request.seq), start=False)
        count = len(requests)
        # A PS that holds no variables still counts steps, so every PS agrees on the global step.
        if self.optimizer is not None:
            for param, grad in zip(self.params, grads, strict=True):
                param.grad = grad.div_(count) if count != 1 else grad
            self.optimizer.step()
            for param in self.params:
                param.grad = None
        if self.table_optimizer is not None:
            # Every table gets a gradient, empty if no row of it was looked up: as a whole table does in one
            # process, so step counts (Adam's bias correction) stay those of single-process training.
            for table, grads_of_table in zip(self.tables, row_grads, strict=True):
                table.grad = row_gradient(table, grads_of_table, count)
            self.table_optimizer.step()
            for table in self.tables:
                table.grad = None
        self.stats["apply_s"] += (time.perf_counter_ns() - started) / 1e9
        if recorder is not None:
            worker = int(requests[0].header["w"]) if count == 1 else -1
            nbytes = sum(g.nbytes for g in grads) + sum(r.nbytes + v.nbytes for t in row_grads for r, v in t)
            recorder.end("apply", self.step, started, worker, nbytes)
        self.step += 1
        self.stats["applied"] += 1
        self._snapshot = None
        every = self.config.snapshot_every_n_steps
        if (every and self.step % every == 0) or self.step == self.snapshot_at:
            self.snapshots[self.step] = capture(self.step, self._parts(), self.iterators)
            # Held until the chief has saved them; see _MAX_SNAPSHOTS for what happens when it falls behind.

    def _buffers(self, request: Request, trailing: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One tensor per group of pieces the sender sent as separate frames (always a fresh copy): a flat one
        per dtype, or a group's single piece as it is; and the `trailing` frames after the groups, as they came."""
        counts = request.header.get("n", [])
        if len(counts) < len(self.dtypes) or sum(counts) + trailing != len(request.tensors):
            raise ValueError(
                f"{request.op!r} from {request.sender} carries {len(request.tensors)} pieces in groups {counts} "
                f"and {trailing} more; ps:{self.index} holds the dtypes {self.dtypes} and {len(self.tables)} tables"
            )
        buffers, start = [], 0
        for count in counts:
            pieces = request.tensors[start : start + count]
            buffers.append(torch.cat(pieces) if pieces else torch.empty(0))
            start += count
        return buffers, request.tensors[start:]

    def _row_grads(self, request: Request, frames: list[torch.Tensor]) -> list[list[RowGrad]]:
        """A push's (row numbers, values) frame pairs, one pair per table, checked before anything is applied."""
        row_grads = []
        for index, table in enumerate(self.tables):
            rows, values = frames[2 * index], frames[2 * index + 1]
            check_row_grad(rows, values, table, f"push from {request.sender} for table {index} of ps:{self.index}")
            row_grads.append([(rows, values)])
        return row_grads

    # -- handlers -----------------------------------------------------------------------------

    def _on_init(self, request: Request) -> None:
        header = request.header
        self.config = ApplyConfig.from_json(header["apply"])
        self.dtypes = list(header["dtypes"])
        num_parts = len(self.dtypes) + int(header.get("tables", 0))
        buffers, _ = self._buffers(request)
        self.params = [torch.nn.Parameter(t, requires_grad=False) for t in buffers[: len(self.dtypes)]]
        self.tables = [torch.nn.Parameter(t, requires_grad=False) for t in buffers[len(self.dtypes) : num_parts]]
        spec = OptimizerSpec.from_json(header["optimizer"])
        self.optimizer = spec.build(list(self.params)) if self.params else None
        self.table_optimizer = spec.build_sparse(list(self.tables)) if self.tables else None
        if "slots" in header:
            load_slots(self._parts(), header["slots"], header["scalars"], buffers[num_parts:])
        self.iterators = dict(header.get("iterators", {}))
        self.step = int(header.get("step", 0))
        self.active = set(range(self.config.num_workers))
        self.clocks = dict.fromkeys(self.active, 0)
        self._snapshot = None
        self.initialized = True
        self.server.reply(request, self._header())

    def _on_pull(self, request: Request) -> None:
        min_step = int(request.header.get("min_step", 0))
        if self.step >= min_step or self.finished:
            self._reply_params(request)
        else:
            self._pulls.append((request, min_step))

    def _on_rows(self, request: Request) -> None:
        """The rows a worker's batch looks up: for each table named in the header, the rows its frame lists."""
        indices = request.header["tables"]
        if len(indices) != len(request.tensors) or not all(0 <= i < len(self.tables) for i in indices):
            raise ValueError(
                f"'rows' from {request.sender} asks for tables {indices} with {len(request.tensors)} frames of row "
                f"numbers; ps:{self.index} holds {len(self.tables)} tables"
            )
        values = []
        for index, rows in zip(indices, request.tensors, strict=True):
            check_rows(rows, self.tables[index], f"'rows' from {request.sender} for table {index} of ps:{self.index}")
            # A copy, so the reply can go out zero-copy while later updates change the table.
            values.append(self.tables[index].detach().index_select(0, rows))
        self.server.reply(request, self._header(), values)

    def _on_push(self, request: Request) -> None:
        worker = int(request.header["w"])
        if self.finished:
            self.stats["dropped_after_max_steps"] += 1
            self.server.reply(request, self._header(dropped=True))
            return
        mode = self.config.mode
        if mode == "sync" and self._is_stale(request):
            return
        started = time.perf_counter_ns()
        grads, row_frames = self._buffers(request, trailing=2 * len(self.tables))
        row_grads = self._row_grads(request, row_frames)
        if "it" in request.header:
            self.iterators[f"worker:{worker}"] = request.header["it"]
        if mode == "sync":
            self._accumulate(grads, row_grads)
        if (recorder := get_recorder()) is not None:
            nbytes = sum(g.nbytes for g in grads) + sum(f.nbytes for f in row_frames)
            recorder.end("receive", self.step, started, worker, nbytes)
        if mode == "sync":
            self._waiting_for_update.append(request)
            self._maybe_apply_sync()
            return
        self._apply(grads, row_grads, [request])
        self.clocks[worker] = self.clocks.get(worker, 0) + 1
        if mode == "ssp":
            self._held.append((request, self.clocks[worker]))
            self._release_held()
        elif request.header.get("want_params", True):
            self._reply_params(request)
        else:
            self.server.reply(request, self._header())
        self._release_pulls()

    def _is_stale(self, request: Request) -> bool:
        """sync: a gradient computed on an older version is dropped and counted; its sender gets the current one."""
        base_step = int(request.header["base_step"])
        if base_step > self.step:
            raise ValueError(f"push for step {base_step} arrived before ps:{self.index} reached it (at {self.step})")
        if base_step == self.step:
            return False
        self.stats["dropped_stale"] += 1
        self._reply_params(request, stale=True)
        return True

    def _accumulate(self, grads: list[torch.Tensor], row_grads: list[list[RowGrad]]) -> None:
        """Sum the dense gradients; keep the row-sparse ones, summed row by row when the update is applied."""
        if self._num_accumulated == 0:
            self._accumulated, self._accumulated_rows = grads, row_grads
        else:
            for total, grad in zip(self._accumulated, grads, strict=True):
                total.add_(grad)
            for kept, pushed in zip(self._accumulated_rows, row_grads, strict=True):
                kept.extend(pushed)
        self._num_accumulated += 1

    def _maybe_apply_sync(self) -> None:
        needed = min(self.config.replicas, max(len(self.active), 1))
        if self._num_accumulated == 0 or self._num_accumulated < needed:
            return
        waiting, self._waiting_for_update = self._waiting_for_update, []
        assert len(waiting) == self._num_accumulated
        self._apply(self._accumulated, self._accumulated_rows, waiting)
        self._accumulated, self._accumulated_rows, self._num_accumulated = [], [], 0
        for request in waiting:
            self._reply_params(request)
        self._release_pulls()

    def _release_held(self) -> None:
        if not self._held:
            return
        active_clocks = [self.clocks.get(w, 0) for w in self.active]
        slowest = min(active_clocks) if active_clocks else None
        still_held = []
        for request, clock in self._held:
            # The worker wants to start step `clock`; it may while it is at most max_staleness ahead.
            if slowest is None or clock - slowest <= self.config.max_staleness or self.finished:
                self._reply_params(request)
            else:
                still_held.append((request, clock))
        self._held = still_held

    def _release_pulls(self) -> None:
        if not self._pulls:
            return
        ready = [(r, s) for r, s in self._pulls if self.step >= s or self.finished]
        self._pulls = [(r, s) for r, s in self._pulls if not (self.step >= s or self.finished)]
        for request, _ in ready:
            self._reply_params(request)

    def _on_done(self, request: Request) -> None:
        self.active.discard(int(request.header["w"]))
        self.server.reply(request, self._header())
        if self.config.mode == "sync":
            self._maybe_apply_sync()
        self._release_held()

    def _on_step(self, request: Request) -> None:
        header = self._header(initialized=self.initialized, snapshots=sorted(self.snapshots), stats=self.stats)
        self.server.reply(request, header)

    def _on_state(self, request: Request) -> None:
        """Parameters, optimizer slots and input positions: now, or as snapshotted at `snapshot` (for checkpoints)."""
        wanted = request.header.get("snapshot")
        if wanted is None:
            state = capture(self.step, self._parts(), self.iterators)
        elif wanted in self.snapshots:
            state = self.snapshots[wanted]
        else:
            raise ValueError(f"no snapshot at step {wanted}; ps:{self.index} holds {sorted(self.snapshots)}")
        stats = {**self.stats, "duplicates": self.server.duplicates}
        self.server.reply(request, self._header(dtypes=self.dtypes, stats=stats, **state.header()), state.tensors())

    def _on_snapshot_at(self, request: Request) -> None:
        """Snapshot when the global step reaches `step` (a time-based checkpoint picks a step just ahead)."""
        step = int(request.header["step"])
        if step < self.step:
            raise ValueError(f"snapshot step {step} already passed; ps:{self.index} is at {self.step}")
        if step == self.step:
            self.snapshots[step] = capture(self.step, self._parts(), self.iterators)
        else:
            self.snapshot_at = step
        self.server.reply(request, self._header())

    def _on_release_snapshots(self, request: Request) -> None:
        """The chief saved every snapshot up to `step`."""
        for step in [s for s in self.snapshots if s <= int(request.header["step"])]:
            del self.snapshots[step]
        self.server.reply(request, self._header())
        while self._deferred_pushes and len(self.snapshots) < _MAX_SNAPSHOTS:
            self._on_push(self._deferred_pushes.pop(0))

    def _on_stop(self, request: Request) -> None:
        """End training at the current step (early stopping): later pushes are dropped, workers told to stop."""
        self.config = dataclasses.replace(self.config, max_steps=self.step)
        self.server.reply(request, self._header())
        self._release_held()
        self._release_pulls()
        if self.config.mode == "sync":
            for waiting in self._waiting_for_update:
                self._reply_params(waiting)
            self._waiting_for_update, self._accumulated, self._num_accumulated = [], [], 0
            self._accumulated_rows = []

    def _on_shutdown(self, request: Request) -> None:
        self.server.reply(request, self._header())
        self._shutdown = True
