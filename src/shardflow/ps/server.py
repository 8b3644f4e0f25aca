"""The parameter server: holds this PS's shards in flat buffers and row-sparse tables, decodes each request
through ps/protocol.py, hands pushes and pulls to the update rule (ps/apply.py) and answers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from shardflow import faults
from shardflow.comm.server import LogLimiter, Request, Server
from shardflow.profile import spans
from shardflow.profile.recorder import flow_id, get_recorder
from shardflow.ps import clipping, protocol
from shardflow.ps.apply import ApplyConfig, Gradients, Refused, Updates, all_finite
from shardflow.ps.lanes import Lane, LaneError, open_lane
from shardflow.ps.optimizers import OptimizerSpec
from shardflow.ps.protocol import PSProtocolError, StatusReply, StepReply
from shardflow.ps.sparse import RowGrad, check_row_grad, check_rows, row_gradient
from shardflow.ps.state import Part, Snapshots, capture, load_slots

log = logging.getLogger(__name__)

RESTORED = "the parameter servers were restored from a checkpoint after one was lost"
"""The start of the error a PS answers a worker's push with after a restore, until the worker rejoins."""
_FENCED = (protocol.Push, protocol.NonFinite, protocol.Done)
"""What a worker sends that changes the update rule's state: refused from a worker that has not rejoined since a
restore (not `Rejoin` nor `Lost`, which subclass `Done`)."""


def _finite(gradients: Gradients) -> bool:
    """Whether every dense buffer and row-sparse value of a push is finite."""
    grads, row_grads = gradients
    return all_finite([*grads, *(values for table in row_grads for _, values in table)])


def _nbytes(gradients: Gradients) -> int:
    grads, row_grads = gradients
    return sum(g.nbytes for g in grads) + sum(r.nbytes + v.nbytes for t in row_grads for r, v in t)


class ParameterServer:
    """Serves one PS's variables. Single-threaded: requests are handled in arrival order, replies may be deferred."""

    def __init__(
        self,
        server: Server,
        index: int,
        *,
        norm_exchange: clipping.NormExchange | None = None,
        on_initialised: Callable[[], None] = lambda: None,
    ) -> None:
        self.server = server
        self.index = index
        self.name = f"ps:{index}"
        self.dtypes: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        # Row-sparse pieces (embedding tables), each a tensor of its own, read and updated a few rows at a time.
        self.tables: list[torch.nn.Parameter] = []
        self.table_optimizer: torch.optim.Optimizer | None = None
        self.optimizer_spec: OptimizerSpec | None = None
        """The optimizer's spec with its learning-rate schedule and clipping; None until initialised."""
        self.norm_exchange = norm_exchange
        """How this PS agrees a sync step's gradient norm with the others (clip_grad_norm); None: it is the only PS."""
        self.limits: protocol.Limits | None = None
        """What requests are checked against; None until the chief initialised this PS."""
        self.on_initialised = on_initialised
        """Called once the chief's init is applied, before it is answered: no worker has pushed yet."""
        self.updates: Updates[Request] = Updates(ApplyConfig(), 0, self._apply, self._answer)
        self.stats: dict[str, float] = {
            "apply_s": 0.0,
            "malformed": 0,
            "failed": 0,
            "repeated": 0,
            "refused": 0,
            "expired": 0,
            "lane_pushes": 0,
            "lanes_refused": 0,
        }
        """Counters; "refused" and "expired" count requests this PS would not hold and held ones past their
        deadline (see apply.Updates); "lane_pushes" the pushes whose gradients came through a shared-memory lane,
        "lanes_refused" the lanes this PS could not map (their workers use the socket)."""
        self.lanes: dict[str, Lane] = {}
        """The shared-memory lanes of this machine's workers (ps/lanes.py), by sender: at most one per worker."""
        self._lane_senders: dict[int, str] = {}
        self._snapshot: list[torch.Tensor] | None = None
        # Checkpoint snapshots taken at exact steps, until the chief saved them, with the input positions.
        self.snapshots = Snapshots()
        # Per worker, the last of its steps this PS had and (by "worker:<index>") its input position after it: a
        # restarted worker resumes from these (see `_on_rejoin`); ps:0's positions go into checkpoints.
        self.worker_steps: dict[str, int] = {}
        self.iterators: dict[str, Any] = {}
        # Raised by every `init` after a PS was lost (train/checkpoints/restore.py): until a worker rejoins, its pushes
        # belong to the state before the restore and are refused.
        self.generation = 0
        self.rejoined: set[int] = set()
        self._deferred_pushes: list[tuple[Request, protocol.Push | protocol.NonFinite]] = []
        self._handling_since = 0
        self._shutdown = False
        # A flood of bad requests must not flood the log: see LogLimiter.
        self._log_limiter = LogLimiter()
        self._handlers: dict[type[protocol.PSRequest], Callable[[Request, Any], None]] = {
            protocol.Init: self._on_init,
            protocol.Attach: self._on_attach,
            protocol.Pull: self._on_pull,
            protocol.Rows: self._on_rows,
            protocol.Push: self._on_push,
            protocol.NonFinite: self._on_nonfinite,
            protocol.Done: self._on_done,
            protocol.Rejoin: self._on_rejoin,
            protocol.Lost: self._on_lost,
            protocol.Status: self._on_status,
            protocol.GetState: self._on_state,
            protocol.SnapshotAt: self._on_snapshot_at,
            protocol.ReleaseSnapshots: self._on_release_snapshots,
            protocol.Stop: self._on_stop,
            protocol.Shutdown: self._on_shutdown,
        }

    # -- loop ---------------------------------------------------------------------------------

    def serve(
        self,
        should_stop: Callable[[], bool] = lambda: False,
        poll_s: float = 0.5,
        periodic: Callable[[int], None] | None = None,
    ) -> None:
        """Handle requests until a shutdown request arrives or `should_stop()` says the job is over;
        `periodic(global_step)` runs about every `poll_s` seconds, busy or idle, as does the answer to held requests
        past their deadline."""
        next_periodic = time.monotonic() + poll_s
        while not self._shutdown:
            request = self.server.recv(timeout_s=poll_s)
            if time.monotonic() >= next_periodic:
                next_periodic = time.monotonic() + poll_s
                self._expire_held()
                if periodic is not None:
                    periodic(self.step)
            if request is None:
                if should_stop():
                    if self.limits is not None:  # the job is over: what waits here is answered, with stop
                        self.updates.stop()
                    return
                continue
            self.handle(request)

    def handle(self, request: Request) -> None:
        """Decode one request and handle it; whatever goes wrong is answered with an error, never raised."""
        # A push's `receive` span starts here, so it covers the validation of its header and frames too.
        self._handling_since = time.perf_counter_ns()
        try:
            message = protocol.decode_request(request.header, request.tensors, self.limits, request.sender)
            self._check_slots(request, message)
        except PSProtocolError as error:
            self.stats["malformed"] += 1
            self._log("malformed", request.sender, error.op, f"ps:{self.index} refused a malformed request: {error}")
            self.server.reply_error(request, f"ps:{self.index} refused a malformed request: {error}")
            return
        if self.limits is None and not isinstance(message, protocol.BEFORE_INIT):
            self.server.reply_error(request, f"ps:{self.index} is not initialised yet; the chief sends 'init' first")
            return
        if self.generation and type(message) in _FENCED and self._not_rejoined(message):
            # A request of the training before this PS was restored: its worker has not heard of the restore.
            self.server.reply_error(request, f"{RESTORED} (recovery {self.generation}); rejoin first")
            return
        try:
            if isinstance(message, protocol.Push | protocol.NonFinite) and self.snapshots.full:
                self._defer(request, message)
            else:
                self._handlers[type(message)](request, message)
        except Refused as refused:
            self._refuse_to_hold(request, message.op, refused)
        except Exception as error:  # answered and counted: one bad request must not end the job
            self.stats["failed"] += 1
            line = f"ps:{self.index} failed on {message.op!r} from {request.sender}: {error}"
            self._log("failed", request.sender, message.op, line)
            self.server.reply_error(request, f"ps:{self.index} failed on {message.op!r}: {error}")

    def _check_slots(self, request: Request, message: protocol.PSRequest) -> None:
        """A request that names lane slots must name slots of its sender's lane."""
        slot: int | None = getattr(message, "slot", None)
        reply_slot: int | None = getattr(message, "reply_slot", None)
        if slot is None and reply_slot is None:
            return
        lane = self.lanes.get(request.sender)
        for name, value, limit in (("slot", slot, "push_slots"), ("reply_slot", reply_slot, "reply_slots")):
            if value is None:
                continue
            if lane is None:
                raise PSProtocolError(message.op, name, request.sender, "names a lane slot, but no lane is attached")
            if value >= getattr(lane, limit):
                raise PSProtocolError(
                    message.op, name, request.sender, f"is {value}, but the lane has {getattr(lane, limit)} of them"
                )

    def _defer(self, request: Request, push: protocol.Push | protocol.NonFinite) -> None:
        """Hold a push until the chief saved the snapshots this PS holds (see `_on_release_snapshots`)."""
        if len(self._deferred_pushes) >= self.config.held_limit:
            raise Refused(
                f"{len(self._deferred_pushes)} pushes wait already for the chief to save this PS's snapshots, the "
                "most a PS holds (ApplyConfig.max_held_requests)"
            )
        self._deferred_pushes.append((request, push))

    def _refuse_to_hold(self, request: Request, op: str, refused: Refused) -> None:
        self.stats["refused"] += 1
        self._log("refused", request.sender, op, f"ps:{self.index} refused {op!r} from {request.sender}: {refused}")
        self.server.reply_error(request, f"ps:{self.index} refused {op!r}: {refused}")

    def _expire_held(self) -> None:
        """Answer the held requests past their deadline with an error saying what each waited for."""
        for request, waited_for in self.updates.expire():
            self.stats["expired"] += 1
            line = f"ps:{self.index} gave up on {request.op!r} from {request.sender}: {waited_for}"
            self._log("expired", request.sender, request.op, line)
            self.server.reply_error(request, f"ps:{self.index} gave up on {request.op!r}: {waited_for}")

    def _not_rejoined(self, message: protocol.PSRequest) -> bool:
        worker_index: int = getattr(message, "worker_index", -1)
        return worker_index not in self.rejoined

    def _log(self, kind: str, peer: str, op: object, line: str) -> None:
        """Log `line`, the latest `kind` (a key of the stats) of problem with `peer`'s `op`, rate-limited."""
        held_back = self._log_limiter.allow(peer, (kind, op))
        if held_back is not None:
            so_far = {**self.updates.stats, **self.stats}[kind]
            log.warning("%s (%d so far; %d other warnings held back)", line, so_far, held_back)

    def _stats(self) -> dict[str, float]:
        """This PS's counters with its update rule's and its server's (duplicates, and wire_malformed: messages
        that broke the wire format or its limits)."""
        server = {"duplicates": self.server.duplicates, "wire_malformed": self.server.malformed}
        return {**self.updates.stats, **self.stats, **server}

    # -- state --------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.updates.step

    @property
    def config(self) -> ApplyConfig:
        return self.updates.config

    @property
    def finished(self) -> bool:
        return self.updates.finished

    def _reply(
        self,
        request: Request,
        tensors: list[torch.Tensor] | tuple[()] = (),
        *,
        stale: bool = False,
        nonfinite: int = 0,
        duplicate: bool = False,
    ) -> None:
        reply = StepReply(step=self.step, stop=self.finished, stale=stale, nonfinite=nonfinite, duplicate=duplicate)
        self.server.reply(request, reply.header(), tensors)

    def _reply_params(
        self, request: Request, *, stale: bool = False, nonfinite: int = 0, duplicate: bool = False
    ) -> None:
        """Reply with the current parameters: into the reply slot the request named, or as frames."""
        reply_slot: int | None = request.header.get("reply_slot")  # checked against the lane by `_check_slots`
        lane = self.lanes.get(request.sender) if reply_slot is not None else None
        if lane is None or reply_slot is None:
            self._reply(request, self._params_snapshot(), stale=stale, nonfinite=nonfinite, duplicate=duplicate)
            return
        for view, param in zip(lane.reply[reply_slot], self.params, strict=True):
            view.copy_(param)
        reply = StepReply(
            step=self.step, stop=self.finished, stale=stale, nonfinite=nonfinite, duplicate=duplicate, lane=True
        )
        self.server.reply(request, reply.header())

    def _params_snapshot(self) -> list[torch.Tensor]:
        # Replies go out zero-copy while the next update changes the buffers in place, so they carry a copy,
        # made once per version and shared by every reply of that version.
        if self._snapshot is None:
            self._snapshot = [p.detach().clone() for p in self.params]
        return self._snapshot

    def _answer(self, request: Request, *, stale: bool = False, dropped: bool = False, nonfinite: int = 0) -> None:
        """The update rule's reply to a push or pull: the current parameters, or none for a dropped push."""
        if dropped:
            self.server.reply(request, StepReply(step=self.step, stop=self.finished, dropped=True).header())
            return
        started = time.perf_counter_ns()
        self._reply_params(request, stale=stale, nonfinite=nonfinite)
        if (recorder := get_recorder()) is not None:
            worker = request.header.get("worker_index", -1)  # decoded already; pulls carry none
            recorder.end(spans.REPLY, self.step - 1, started, worker)

    def _parts(self) -> list[Part]:
        """Every tensor this PS holds with the optimizer that updates it: the dtype buffers, then the tables."""
        return [(p, self.optimizer) for p in self.params] + [(t, self.table_optimizer) for t in self.tables]

    def _apply(self, gradients: Gradients, pushes: list[Request]) -> None:
        """One update: the mean of the dense gradients and of the row-sparse ones of `len(pushes)` pushes."""
        grads, row_grads = gradients
        started = time.perf_counter_ns()
        recorder = get_recorder()
        if recorder is not None:
            for request in pushes:
                recorder.flow(spans.APPLY, self.step, flow_id(request.sender, request.seq), start=False)
        count = len(pushes)
        dense = [grad.div_(count) if count != 1 else grad for grad in grads] if self.optimizer is not None else []
        # Every table gets a gradient, empty if no row of it was looked up: as a whole table does in one process,
        # so step counts (Adam's bias correction) stay those of single-process training.
        sparse = [row_gradient(t, g, count) for t, g in zip(self.tables, row_grads, strict=True)]
        self._clip_and_schedule(dense + sparse, pushes)
        # A PS that holds no variables still counts steps, so every PS agrees on the global step.
        if self.optimizer is not None:
            for param, grad in zip(self.params, dense, strict=True):
                param.grad = grad
            self.optimizer.step()
            for param in self.params:
                param.grad = None
        if self.table_optimizer is not None:
            for table, grad in zip(self.tables, sparse, strict=True):
                table.grad = grad
            self.table_optimizer.step()
            for table in self.tables:
                table.grad = None
        faults.reached("apply", self.name, self.step + 1)
        self.stats["apply_s"] += (time.perf_counter_ns() - started) / 1e9
        if recorder is not None:
            worker = pushes[0].header["worker_index"] if count == 1 else -1
            recorder.end(spans.APPLY, self.step, started, worker, _nbytes(gradients))
        self._snapshot = None
        new_step = self.step + 1  # the update rule counts it once this returns
        if self.snapshots.due(new_step):
            # Held until the chief has saved it; see state.MAX_SNAPSHOTS for what happens when it falls behind.
            self.snapshots.held[new_step] = capture(new_step, self._parts(), self.iterators, self.worker_steps)

    def _clip_and_schedule(self, grads: list[torch.Tensor], pushes: list[Request]) -> None:
        """Clip this step's gradient (by value, then in sync mode by the global norm agreed with the other PS; see
        ps/clipping.py) and set the learning rate of this global step's update."""
        spec = self.optimizer_spec
        if spec is None:
            return
        if spec.clip_grad_value is not None:
            clipping.clamp_(grads, spec.clip_grad_value)
        if spec.clip_grad_norm is not None and self.config.mode == "sync":
            squared = clipping.squared_norm(grads)
            total = self.norm_exchange(self.step, squared) if self.norm_exchange is not None else squared
            clipping.scale_(grads, clipping.clip_coefficient(total**0.5, spec.clip_grad_norm))
        if spec.schedule is not None:
            for optimizer in (self.optimizer, self.table_optimizer):
                if optimizer is not None:
                    if spec.schedule.from_workers:  # a function of the step: its value came with the push(es)
                        lr = float(pushes[0].header["lr"])
                    else:
                        lr = spec.lr(self.step, optimizer.defaults["lr"])
                    for group in optimizer.param_groups:
                        group["lr"] = lr

    def _gradients(self, request: Request, push: protocol.Push) -> Gradients:
        """A push's dense gradients, one fresh tensor per dtype buffer, and its row-sparse ones, checked against
        the tables before anything is applied."""
        frames, buffers, start = request.tensors, [], 0
        if push.slot is not None:
            # The PS's until it replies: applied in place, or (sync) summed into, as a fresh tensor would be. A
            # sync push's reply may come after its deadline while its gradient stays in the sum: that one is copied.
            self.stats["lane_pushes"] += 1
            views = self.lanes[request.sender].push[push.slot]
            buffers = [view.clone() for view in views] if self.config.mode == "sync" else list(views)
        for count in push.frame_counts:
            pieces = frames[start : start + count]
            if push.slot is None:
                buffers.append(torch.cat(pieces) if pieces else torch.empty(0))
            start += count
        row_grads: list[list[RowGrad]] = []
        for index, table in enumerate(self.tables):
            rows, values = frames[start + 2 * index], frames[start + 2 * index + 1]
            check_row_grad(rows, values, table, f"push from {request.sender} for table {index} of ps:{self.index}")
            row_grads.append([(rows, values)])
        return buffers, row_grads

    # -- handlers -----------------------------------------------------------------------------

    def _on_init(self, request: Request, init: protocol.Init) -> None:
        frames, buffers, start = request.tensors, [], 0
        for count in init.frame_counts:
            buffers.append(torch.cat(frames[start : start + count]) if count else torch.empty(0))
            start += count
        self.dtypes = list(init.dtypes)
        self.params = [torch.nn.Parameter(t, requires_grad=False) for t in buffers]
        tables = frames[start : start + init.num_tables]
        self.tables = [torch.nn.Parameter(t.clone(), requires_grad=False) for t in tables]
        self.optimizer = init.optimizer.build(list(self.params)) if self.params else None
        self.table_optimizer = init.optimizer.build_sparse(list(self.tables)) if self.tables else None
        self.optimizer_spec = init.optimizer
        if init.slots:
            load_slots(self._parts(), list(init.slots), list(init.scalars), frames[start + init.num_tables :])
        self.iterators = dict(init.iterators)
        self.worker_steps = dict(init.worker_steps)
        self.generation = init.generation
        # Pushes held back before a restore belong to the training before it; their workers have moved on.
        self._deferred_pushes = []
        if isinstance(self.norm_exchange, clipping.StoreNormExchange):
            self.norm_exchange.generation = init.generation
        self.rejoined = set()
        self.updates = Updates(init.apply, init.step, self._apply, self._answer)
        self.snapshots = Snapshots(init.apply.snapshot_every_n_steps)
        self.limits = protocol.Limits(
            num_workers=init.apply.num_workers,
            buffers=tuple((p.dtype, p.numel()) for p in self.params),
            num_tables=len(self.tables),
        )
        self._snapshot = None
        self.on_initialised()
        self._reply(request)

    def _on_attach(self, request: Request, attach: protocol.Attach) -> None:
        assert self.limits is not None  # Attach is served after init only
        try:
            if not any(numel for _, numel in self.limits.buffers):
                raise LaneError("it holds no dense variables")
            lane = open_lane(attach.pid, attach.fd, self.limits.buffers, attach.push_slots, attach.reply_slots)
        except LaneError as error:
            self.stats["lanes_refused"] += 1
            line = f"ps:{self.index} cannot map the shared-memory lane of {request.sender}: {error}"
            self._log("lanes_refused", request.sender, attach.op, f"{line}; it goes on over the socket")
            self.server.reply_error(request, line)
            return
        # One per worker: a restarted worker (a new sender) replaces the lane of the process it replaces, whose memory
        # goes once nothing of this PS uses it.
        self._drop_lane(attach.worker_index)
        self.lanes[request.sender] = lane
        self._lane_senders[attach.worker_index] = request.sender
        self._reply(request)

    def _drop_lane(self, worker_index: int) -> None:
        sender = self._lane_senders.pop(worker_index, None)
        if sender is not None:
            self.lanes.pop(sender, None)  # gone already if that sender attached again as another worker

    def _on_pull(self, request: Request, pull: protocol.Pull) -> None:
        self.updates.pull(request, pull.min_step)

    def _on_rows(self, request: Request, rows: protocol.Rows) -> None:
        """The rows a worker's batch looks up: for each table named, the rows its frame lists."""
        values = []
        for index, row_numbers in zip(rows.table_indices, request.tensors, strict=True):
            table = self.tables[index]
            check_rows(row_numbers, table, f"'rows' from {request.sender} for table {index} of ps:{self.index}")
            # A copy, so the reply can go out zero-copy while later updates change the table.
            values.append(table.detach().index_select(0, row_numbers))
        self._reply(request, values)

    def _repeated(self, request: Request, worker_index: int, local_step: int) -> bool:
        """Whether this PS already had this step of this worker: a restarted worker repeats the steps that some PS
        missed when it died (the others had them), and each PS takes every step once. Answered here if so."""
        if local_step > self.worker_steps.get(f"worker:{worker_index}", 0):
            return False
        self.stats["repeated"] += 1
        self._reply_params(request, duplicate=True)
        return True

    def _had(self, worker_index: int, local_step: int, input_state: dict[str, Any] | None) -> None:
        """This PS took step `local_step` of the worker, to apply (or accumulate) or to refuse as non-finite: it is
        not taken again, and the worker resumes after it."""
        self.worker_steps[f"worker:{worker_index}"] = local_step
        if input_state is not None:
            self.iterators[f"worker:{worker_index}"] = input_state

    def _on_push(self, request: Request, push: protocol.Push) -> None:
        started = self._handling_since
        schedule = self.optimizer_spec.schedule if self.optimizer_spec is not None else None
        if schedule is not None and schedule.from_workers and push.lr is None:
            problem = "its learning-rate schedule is a function of the step, so every push must carry its lr"
            self.server.reply_error(request, f"ps:{self.index} refused a push of worker:{push.worker_index}: {problem}")
            return
        if self._repeated(request, push.worker_index, push.local_step):
            return
        # A push dropped (after max_steps, or stale in sync) is not had: its batch is read again after a restore.
        if not self.updates.admit(request, push.base_step):
            return
        self._had(push.worker_index, push.local_step, push.input_state)
        gradients = self._gradients(request, push)
        if (recorder := get_recorder()) is not None:
            recorder.end(spans.RECEIVE, self.step, started, push.worker_index, _nbytes(gradients))
        # Checked before it is applied or (sync) accumulated, so a NaN never reaches the parameters, the optimizer
        # slots or the sum of the other replicas. A shardflow worker checks first and sends `NonFinite` to every
        # PS instead (ps/client.py); this is the last guard, for a push that only this PS would refuse.
        if not _finite(gradients):
            self._refuse(request, push.worker_index, push.base_step, "gradients")
            return
        self.updates.push(request, push.worker_index, gradients)

    def _on_nonfinite(self, request: Request, nonfinite: protocol.NonFinite) -> None:
        if self._repeated(request, nonfinite.worker_index, nonfinite.local_step):
            return
        # The refused batch was read: a restore goes on after it, as after an applied one.
        self._had(nonfinite.worker_index, nonfinite.local_step, nonfinite.input_state)
        self._refuse(request, nonfinite.worker_index, nonfinite.base_step, nonfinite.found_in)

    def _refuse(self, request: Request, worker_index: int, base_step: int, found_in: str) -> None:
        self.updates.refuse(request, worker_index)
        self._log(
            "nonfinite",
            f"worker:{worker_index}",
            found_in,
            f"ps:{self.index} refused a step of worker:{worker_index} on the parameters of global step {base_step}: "
            f"its {found_in} held NaN or inf",
        )

    def _on_done(self, request: Request, done: protocol.Done) -> None:
        self._drop_lane(done.worker_index)
        self._reply(request)
        self.updates.done(done.worker_index)

    def _on_rejoin(self, request: Request, rejoin: protocol.Rejoin) -> None:
        worker = rejoin.worker_index
        self.updates.rejoined(worker)
        self.rejoined.add(worker)
        name = f"worker:{worker}"
        reply = protocol.RejoinReply(
            step=self.step,
            stop=self.finished,
            local_step=self.worker_steps.get(name, 0),
            input_state=self.iterators.get(name) if name in self.worker_steps else None,
            done=worker in self.updates.finished_workers,
            generation=self.generation,
        )
        self.server.reply(request, reply.header())

    def _on_lost(self, request: Request, lost: protocol.Lost) -> None:
        self._reply(request)
        self.updates.lost(lost.worker_index)

    def _on_status(self, request: Request, _: protocol.Status) -> None:
        reply = StatusReply(
            step=self.step,
            stop=self.finished,
            initialized=self.limits is not None,
            snapshots=tuple(sorted(self.snapshots.held)),
            stats=self._stats(),
            generation=self.generation,
        )
        self.server.reply(request, reply.header())

    def _on_state(self, request: Request, get: protocol.GetState) -> None:
        """Parameters, optimizer slots and input positions: now, or as snapshotted (for checkpoints)."""
        if get.snapshot_step is None:
            state = capture(self.step, self._parts(), self.iterators, self.worker_steps)
        else:
            state = self.snapshots.get(get.snapshot_step)
        reply = protocol.StateReply(
            step=self.step,
            stop=self.finished,
            state_step=state.step,
            dtypes=tuple(self.dtypes),
            slots=tuple(state.slots),
            scalars=tuple(state.scalars),
            iterators=state.iterators,
            worker_steps=state.worker_steps,
            stats=self._stats(),
        )
        self.server.reply(request, reply.header(), state.tensors())

    def _on_snapshot_at(self, request: Request, snapshot_at: protocol.SnapshotAt) -> None:
        step = snapshot_at.step
        if step < self.step:
            raise ValueError(f"snapshot step {step} already passed; ps:{self.index} is at {self.step}")
        if step == self.step:
            self.snapshots.held[step] = capture(self.step, self._parts(), self.iterators, self.worker_steps)
        else:
            self.snapshots.at = step
        self._reply(request)

    def _on_release_snapshots(self, request: Request, release: protocol.ReleaseSnapshots) -> None:
        self.snapshots.release(release.through_step)
        self._reply(request)
        while self._deferred_pushes and not self.snapshots.full:
            self._handle_deferred(*self._deferred_pushes.pop(0))

    def _handle_deferred(self, request: Request, push: protocol.Push | protocol.NonFinite) -> None:
        try:
            self._handlers[type(push)](request, push)
        except Refused as refused:
            self._refuse_to_hold(request, push.op, refused)
        except Exception as error:  # as in handle(): answered and counted
            self.stats["failed"] += 1
            line = f"ps:{self.index} failed on a deferred push from {request.sender}: {error}"
            self._log("failed", request.sender, push.op, line)
            self.server.reply_error(request, f"ps:{self.index} failed on {push.op!r}: {error}")

    def _on_stop(self, request: Request, _: protocol.Stop) -> None:
        self._reply(request)
        self.updates.stop()

    def _on_shutdown(self, request: Request, _: protocol.Shutdown) -> None:
        self._reply(request)
        self._shutdown = True
