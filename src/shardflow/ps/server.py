"""The parameter server: decodes each request through ps/protocol.py into its typed message, hands it to its
handler (one per request type), whose pushes and pulls go to the update rule (ps/update_rules.py), and answers."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from shardflow import faults
from shardflow.comm.server import LogLimiter, Request, Server
from shardflow.profile import spans
from shardflow.profile.recorder import flow_id, get_recorder
from shardflow.ps import clipping, protocol
from shardflow.ps.deferred import Deferred, Received
from shardflow.ps.lanes import AttachedLanes, LaneError
from shardflow.ps.protocol import PSProtocolError, StatusReply, StepReply
from shardflow.ps.shards import Shards, finite, nbytes
from shardflow.ps.state import ShardState, Snapshots, capture
from shardflow.ps.update_rules import ApplyConfig, Gradients, Refused, Updates
from shardflow.ps.worker_progress import WorkerProgress

log = logging.getLogger(__name__)

RESTORED = "the parameter servers were restored from a checkpoint after one was lost"
"""The start of the error a PS answers a worker's push with after a restore, until the worker rejoins."""
_FENCED = (protocol.Push, protocol.NonFinite, protocol.Done)
"""A worker's requests that change the update rule's state: refused from a sender not rejoined since a restore."""
_WITH_PARAMS = (protocol.Push, protocol.NonFinite, protocol.Pull)
"""The requests answered with the parameters, into a reply slot of the sender's lane if they name one."""
COUNTERS = ("apply_s", "malformed", "failed", "repeated", "refused", "expired", "lane_pushes", "lanes_refused")
"""A PS's own counters: "refused" and "expired" count requests this PS would not hold and held ones past their
deadline (see apply.Updates); "lane_pushes" the pushes whose gradients came through a shared-memory lane,
"lanes_refused" the lanes this PS could not map (their workers use the socket)."""


Handler = Callable[["ParameterServer", Request, Any], None]
"""A ParameterServer's handler of one request type, given the request and its decoded message."""


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
        self.shards = Shards()
        self.norm_exchange = norm_exchange
        """How this PS agrees a sync step's gradient norm with the others (clip_grad_norm); None: it is the only PS."""
        self.limits: protocol.Limits | None = None
        """What requests are checked against; None until the chief initialised this PS."""
        self.on_initialised = on_initialised
        """Called once the chief's init is applied, before it is answered: no worker has pushed yet."""
        self.updates: Updates[Received] = Updates(ApplyConfig(), 0, self._apply, self._answer)
        self.stats: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.lanes = AttachedLanes()
        """The shared-memory lanes of this machine's workers (ps/lanes.py), by sender: at most one per worker."""
        # Checkpoint snapshots taken at exact steps, until the chief saved them, with the input positions.
        self.snapshots = Snapshots()
        self.progress = WorkerProgress()
        # Raised by every `init` after a PS was lost (train/checkpoints/restore.py): until a sender rejoins, its pushes
        # belong to the state before and are refused; by sender, so those a worker's previous client left queued too.
        self.generation = 0
        self.rejoined: set[str] = set()
        self.deferred = Deferred()
        self._handling_since = 0
        self._pushed_step: int | None = None  # the workers' global step the last push carried
        self._shutdown = False
        # A flood of bad requests must not flood the log: see LogLimiter.
        self._log_limiter = LogLimiter()

    # -- loop ---------------------------------------------------------------------------------

    def serve(
        self,
        should_stop: Callable[[], bool] = lambda: False,
        poll_s: float = 0.5,
        periodic: Callable[[int | None], None] | None = None,
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
                    periodic(self.capture_step)
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
            if self._turned_away(request, message):
                return
            self._check_slots(request.sender, message)
        except PSProtocolError as error:
            self.stats["malformed"] += 1
            self._log("malformed", request.sender, error.op, f"ps:{self.index} refused a malformed request: {error}")
            self.server.reply_error(request, f"ps:{self.index} refused a malformed request: {error}")
            return
        if self.deferred.waits(message, self.snapshots.full):  # held: ps/deferred.py
            self._guarded(request, message, lambda ps, r, m: ps.deferred.add((r, m), ps.config.held_limit))
        else:
            self._guarded(request, message, HANDLERS[type(message)])

    def _turned_away(self, request: Request, message: protocol.PSRequest) -> bool:
        """Answer a request of another generation than this PS's: True if it was. Before the lane slots are checked:
        a slot of a lane to this PS's previous process names none here."""
        if self.limits is None and not isinstance(message, protocol.BEFORE_INIT):
            self.server.reply(request, protocol.Unserved(unserved=self.index).header())  # sender awaits the restore
            return True
        if self.generation and isinstance(message, _FENCED) and request.sender not in self.rejoined:
            # A request of the training before this PS was restored: its worker has not heard of the restore.
            self.server.reply_error(request, f"{RESTORED} (recovery {self.generation}); rejoin first")
            return True
        return False

    def _guarded(self, request: Request, message: protocol.PSRequest, handler: Handler) -> None:
        """Run `handler`; a request it cannot hold or serve is answered with an error and counted."""
        try:
            handler(self, request, message)
        except Refused as refused:
            self._fail(request, "refused", message.op, "refused", str(refused))
        except Exception as error:  # answered and counted: one bad request must not end the job
            self._fail(request, "failed", message.op, "failed on", str(error))

    def _fail(self, request: Request, kind: str, op: str, verb: str, why: str) -> None:
        """Count `kind` (a key of the stats), and answer `request` with the error "ps:K <verb> '<op>': <why>"."""
        self.stats[kind] += 1
        self._log(kind, request.sender, op, f"ps:{self.index} {verb} {op!r} from {request.sender}: {why}")
        self.server.reply_error(request, f"ps:{self.index} {verb} {op!r}: {why}")

    def _check_slots(self, sender: str, message: protocol.PSRequest) -> None:
        """A request that names lane slots must name slots of its sender's lane."""
        slot = message.slot if isinstance(message, protocol.Push) else None
        reply_slot = message.reply_slot if isinstance(message, _WITH_PARAMS) else None
        problem = self.lanes.slot_problem(sender, slot, reply_slot)
        if problem is not None:
            raise PSProtocolError(message.op, problem[0], sender, problem[1])

    def _handle_deferred(self, end_hold: bool = False) -> None:
        self.deferred.holding &= not end_hold
        for request, message in self.deferred.release(lambda: self.snapshots.full):
            self._guarded(request, message, HANDLERS[type(message)])

    def _expire_held(self) -> None:
        """Answer the held requests past their deadline with an error saying what each waited for."""
        for (request, message), waited_for in self.updates.expire():
            self._fail(request, "expired", message.op, "gave up on", waited_for)

    def _log(self, kind: str, peer: str, op: object, line: str) -> None:
        """Log `line`, the latest `kind` (a key of the stats) of problem with `peer`'s `op`, rate-limited."""
        held_back = self._log_limiter.allow(peer, (kind, op))
        if held_back is not None:
            so_far = {**self.updates.stats, **self.stats}[kind]
            log.warning("%s (%d so far; %d other warnings held back)", line, so_far, held_back)

    def table_counters(self) -> dict[str, int]:
        return self.shards.embeddings.stats()

    def _stats(self) -> dict[str, float]:
        """This PS's counters with its update rule's and its server's (duplicates, and wire_malformed: messages
        that broke the wire format or its limits)."""
        server = {"duplicates": self.server.duplicates, "wire_malformed": self.server.malformed}
        return {**self.updates.stats, **self.stats, **server, **self.shards.embeddings.stats()}

    # -- state --------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.updates.step

    @property
    def config(self) -> ApplyConfig:
        return self.updates.config

    @property
    def capture_step(self) -> int | None:
        """The global step captures count: this PS's, or (ApplyConfig.pushes_carry_global_step) the last push's."""
        return self._pushed_step if self.config.pushes_carry_global_step else self.step

    def _at(self, step: int) -> int:
        """The step a span is recorded at: `step` of this PS, or (pushes_carry_global_step) the last push's."""
        pushed = self._pushed_step if self.config.pushes_carry_global_step else None
        return step if pushed is None else pushed

    @property
    def finished(self) -> bool:
        return self.updates.finished

    def _reply(self, request: Request, tensors: list[torch.Tensor] | tuple[()] = ()) -> None:
        self.server.reply(request, StepReply(step=self.step, stop=self.finished).header(), tensors)

    def _reply_params(
        self,
        received: Received,
        *,
        stale: bool = False,
        nonfinite: int = 0,
        duplicate: bool = False,
        dropped: bool = False,
    ) -> None:
        """Reply with the parameters (none to a `dropped` push), and the rows of a lookup riding on it (Push.lookup)."""
        message = received.message
        assert not isinstance(message, protocol.Lookup), "a lookup is answered with rows"
        request, reply_slot = received.request, message.reply_slot  # checked by `_check_slots`
        lane = self.lanes.get(request.sender) if reply_slot is not None and not dropped else None
        if lane is not None and reply_slot is not None:
            self.shards.copy_params_into(lane.reply[reply_slot])
        frames = [] if lane is not None or dropped else self.shards.params_snapshot(message.wire_dtype)
        rows = self.shards.riding_rows(message, request.tensors, f"'push' from {request.sender} of ps:{self.index}")
        flags = StepReply(step=self.step, stop=self.finished, stale=stale, nonfinite=nonfinite, duplicate=duplicate)
        reply = msgspec.structs.replace(flags, dropped=dropped, lane=lane is not None, rows=len(rows))
        self.server.reply(request, reply.header(), [*frames, *rows])

    def _answer(self, received: Received, *, stale: bool = False, dropped: bool = False, nonfinite: int = 0) -> None:
        """The update rule's reply to a push or pull: the current parameters, or none for a dropped push; to a
        lookup, the rows it asked for."""
        if isinstance(received.message, protocol.Lookup):  # held, so answered here: its errors too
            self._guarded(received.request, received.message, ParameterServer._answer_lookup)
            return
        started = time.perf_counter_ns()
        self._reply_params(received, stale=stale, nonfinite=nonfinite, dropped=dropped)
        if (recorder := get_recorder()) is not None:
            message = received.message
            worker = message.worker_index if isinstance(message, protocol.Push | protocol.NonFinite) else -1
            recorder.end(spans.REPLY, self._at(self.step - 1), started, worker)

    def _apply(self, gradients: Gradients, pushes: list[Received]) -> None:
        """One update: the mean of the dense gradients and of the row-sparse ones of `len(pushes)` pushes."""
        started, recorder, step = time.perf_counter_ns(), get_recorder(), self._at(self.step)
        if recorder is not None:
            for request, _ in pushes:
                recorder.flow(spans.APPLY, step, flow_id(request.sender, request.seq), start=False)
        first = pushes[0].message
        lr = first.lr if isinstance(first, protocol.Push) else None
        self.shards.apply(gradients, len(pushes), self.step, lr, self.norm_exchange)
        faults.reached("apply", self.name, self.step + 1)
        self.stats["apply_s"] += (time.perf_counter_ns() - started) / 1e9
        if recorder is not None:
            alone = len(pushes) == 1 and isinstance(first, protocol.Push | protocol.NonFinite)
            worker = first.worker_index if alone and not isinstance(first, protocol.Pull | protocol.Lookup) else -1
            recorder.end(spans.APPLY, step, started, worker, nbytes(gradients))
        new_step = self.step + 1  # the update rule counts it once this returns
        if self.snapshots.due(new_step):
            # Held until the chief has saved it; see state.MAX_SNAPSHOTS for what happens when it falls behind.
            self.snapshots.held[new_step] = self._capture(new_step)

    def _capture(self, step: int) -> ShardState:
        """This PS's state now, as of global step `step`; its tables' rows go to files now (too big to copy)."""
        files = self.shards.embeddings.snapshot(step)
        return capture(step, self.shards.parts(), self.progress.iterators, self.progress.steps, *files)

    # -- handlers of the chief's requests -------------------------------------------------------------

    def _on_init(self, request: Request, init: protocol.Init) -> None:
        staging = Path(init.embedding_staging) if init.embedding_staging is not None else None
        self.shards = Shards.from_init(init, request.tensors, self.index, staging)
        self.progress = WorkerProgress(init.worker_steps, init.iterators)
        self._pushed_step = None
        self.generation = init.generation
        self.deferred.clear()
        if isinstance(self.norm_exchange, clipping.StoreNormExchange):
            self.norm_exchange.generation = init.generation
        self.rejoined = set()
        self.updates = Updates(init.apply, init.step, self._apply, self._answer)
        self.snapshots = Snapshots(init.apply.snapshot_every_n_steps)
        self.limits = self.shards.limits(init.apply.num_workers)
        self.on_initialised()
        self._reply(request)

    def _on_status(self, request: Request, _: protocol.Status) -> None:
        reply = StatusReply(
            step=self.step,
            stop=self.finished,
            initialized=self.limits is not None,
            snapshots=tuple(sorted(self.snapshots.held)),
            stats=self._stats(),
            generation=self.generation,
            pid=os.getpid(),
            holding=self.deferred.holding,
        )
        self.server.reply(request, reply.header())

    def _on_state(self, request: Request, get: protocol.GetState) -> None:
        """Parameters, optimizer slots and input positions: now, or as snapshotted (for checkpoints)."""
        if get.snapshot_step is None:
            faults.reached("state", self.name, self.step)
        else:
            faults.reached("snapshot_state", self.name, get.snapshot_step)
        state = self._capture(self.step) if get.snapshot_step is None else self.snapshots.get(get.snapshot_step)
        reply = state.reply(self.step, self.finished, self.shards.dtypes, self._stats())
        self.server.reply(request, reply.header(), state.tensors())

    def _on_snapshot_at(self, request: Request, snapshot_at: protocol.SnapshotAt) -> None:
        step = snapshot_at.step
        faults.reached("snapshot", self.name, step)
        if step < self.step:  # not after a Hold
            self._handle_deferred(end_hold=True)
            raise ValueError(f"snapshot step {step} already passed; ps:{self.index} is at {self.step}")
        if step == self.step:
            self.snapshots.held[step] = self._capture(self.step)
        else:
            self.snapshots.at = step
        self._reply(request)
        self._handle_deferred(end_hold=True)

    def _on_release_snapshots(self, request: Request, release: protocol.ReleaseSnapshots) -> None:
        self.snapshots.release(release.through_step)
        self.shards.embeddings.prune([r for state in self.snapshots.held.values() for r in state.table_files])
        self._reply(request)
        self._handle_deferred()

    def _on_lost(self, request: Request, lost: protocol.Lost) -> None:
        faults.reached("lost", self.name, self.step)
        self._reply(request)
        self.updates.lost(lost.worker_index)

    def _on_hold(self, request: Request, _: protocol.Hold) -> None:
        faults.reached("hold", self.name, self.step)
        self.deferred.holding = True
        self._reply(request)

    def _on_stop(self, request: Request, stop: protocol.Stop) -> None:
        """At the step asked for (the held pushes apply up to it); at this PS's step if that one passed (an error)."""
        faults.reached("stop", self.name, self.step)
        passed = stop.step is not None and stop.step < self.step
        self.updates.stop(None if passed else stop.step)
        if passed:
            self._handle_deferred(end_hold=True)
            raise ValueError(f"training cannot end at global step {stop.step}: ps:{self.index} is at {self.step}")
        self._reply(request)
        self._handle_deferred(end_hold=True)

    def _on_shutdown(self, request: Request, _: protocol.Shutdown) -> None:
        self._reply(request)
        self._shutdown = True

    # -- handlers of the workers' requests ------------------------------------------------------------

    def _on_attach(self, request: Request, attach: protocol.Attach) -> None:
        assert self.limits is not None  # Attach is served after init only
        slots = (attach.push_slots, attach.reply_slots)
        try:
            self.lanes.open(attach.worker_index, request.sender, attach.pid, attach.fd, self.limits.buffers, slots)
        except LaneError as error:
            self.stats["lanes_refused"] += 1
            line = f"ps:{self.index} cannot map the shared-memory lane of {request.sender}: {error}"
            self._log("lanes_refused", request.sender, attach.op, f"{line}; it goes on over the socket")
            self.server.reply_error(request, line)
            return
        self._reply(request)

    def _on_pull(self, request: Request, pull: protocol.Pull) -> None:
        self.updates.pull(Received(request, pull), pull.min_step)

    def _on_rows(self, request: Request, rows: protocol.Rows) -> None:
        """The rows a worker's batch looks up: for each table named, the rows its frame lists."""
        what = f"'rows' from {request.sender} of ps:{self.index}"
        self._reply(request, self.shards.rows(rows.table_indices, request.tensors, what))

    def _on_lookup(self, request: Request, lookup: protocol.Lookup) -> None:
        """Rows of `sf.nn` tables once this PS's step is at least `min_step` (at most max_steps: a lookup sent ahead
        of a step that training ends before gets the last rows)."""
        self.updates.pull(Received(request, lookup), min(lookup.min_step, self.config.max_steps or lookup.min_step))

    def _answer_lookup(self, request: Request, lookup: protocol.Lookup) -> None:
        where = f"'lookup' from {request.sender} of ps:{self.index}"
        self._reply(request, self.shards.embeddings.lookup(lookup.table_indices, request.tensors, where))

    def _repeated(self, received: Received, worker_index: int, local_step: int) -> bool:
        """Whether this PS already had this step of this worker: a restarted worker repeats the steps that some PS
        missed when it died (the others had them), and each PS takes every step once. Answered here if so."""
        had = self.progress.last(worker_index)
        if local_step > had:
            return False
        self.stats["repeated"] += 1
        # Its last step, in the sum of the next sync update still: answered with that update, as its first push.
        if not (local_step == had and self.updates.hold_repeat(received, worker_index)):
            self._reply_params(received, duplicate=True)
        return True

    def _on_push(self, request: Request, push: protocol.Push) -> None:
        started, received = self._handling_since, Received(request, push)
        self._pushed_step = push.local_step - 1
        self.shards.check_push(push, request.tensors, f"'push' from {request.sender} of ps:{self.index}")
        if self._repeated(received, push.worker_index, push.local_step):
            return
        # A push dropped (after max_steps, or stale in sync) is not had: its batch is read again after a restore.
        if not self.updates.admit(received, push.base_step, push.worker_index):
            return
        self.progress.took(push.worker_index, push.local_step, push.input_state)
        gradients = self._gradients(request, push)
        if (recorder := get_recorder()) is not None:
            recorder.end(spans.RECEIVE, self._at(self.step), started, push.worker_index, nbytes(gradients))
        # Checked before it is applied or (sync) accumulated, so a NaN never reaches the parameters, the optimizer
        # slots or the sum of the other replicas. A shardflow worker checks first and sends `NonFinite` to every
        # PS instead (ps/client.py); this is the last guard, for a push that only this PS would refuse.
        if not finite(gradients):
            self._refuse(received, push.worker_index, push.base_step, "gradients")
            return
        self.updates.push(received, push.worker_index, gradients)

    def _gradients(self, request: Request, push: protocol.Push) -> Gradients:
        lane_slot = None
        if push.slot is not None:
            # The PS's until it replies: applied in place, or (sync) summed into, as a fresh tensor would be. A
            # sync push's reply may come after its deadline while its gradient stays in the sum: that one is copied.
            self.stats["lane_pushes"] += 1
            views = self.lanes[request.sender].push[push.slot]
            lane_slot = [view.clone() for view in views] if self.config.mode == "sync" else list(views)
        what = f"push from {request.sender} of ps:{self.index}"
        frames = request.tensors[: len(request.tensors) - len(push.lookup)]  # the ids of a lookup riding on it last
        return self.shards.gradients(push, frames, lane_slot, what)

    def _on_nonfinite(self, request: Request, nonfinite: protocol.NonFinite) -> None:
        received = Received(request, nonfinite)
        if self._repeated(received, nonfinite.worker_index, nonfinite.local_step):
            return
        # The refused batch was read: a restore goes on after it, as after an applied one.
        self.progress.took(nonfinite.worker_index, nonfinite.local_step, nonfinite.input_state)
        self._refuse(received, nonfinite.worker_index, nonfinite.base_step, nonfinite.found_in)

    def _refuse(self, received: Received, worker_index: int, base_step: int, found_in: str) -> None:
        self.updates.refuse(received, worker_index)
        line = f"ps:{self.index} refused a step of worker:{worker_index} on the parameters of global step {base_step}"
        self._log("nonfinite", f"worker:{worker_index}", found_in, f"{line}: its {found_in} held NaN or inf")

    def _on_done(self, request: Request, done: protocol.Done) -> None:
        self.lanes.drop(done.worker_index)
        self._reply(request)
        self.updates.done(done.worker_index)

    def _on_rejoin(self, request: Request, rejoin: protocol.Rejoin) -> None:
        worker = rejoin.worker_index
        self.updates.rejoined(worker)
        self.rejoined.add(request.sender)
        reply = protocol.RejoinReply(
            step=self.step,
            stop=self.finished,
            local_step=self.progress.last(worker),
            input_state=self.progress.position(worker),
            done=worker in self.updates.finished_workers,
            generation=self.generation,
            in_sum=self.updates.in_sum(worker),
        )
        self.server.reply(request, reply.header())


HANDLERS: dict[type[protocol.PSRequest], Handler] = {
    protocol.Init: ParameterServer._on_init,
    protocol.Status: ParameterServer._on_status,
    protocol.GetState: ParameterServer._on_state,
    protocol.SnapshotAt: ParameterServer._on_snapshot_at,
    protocol.ReleaseSnapshots: ParameterServer._on_release_snapshots,
    protocol.Lost: ParameterServer._on_lost,
    protocol.Hold: ParameterServer._on_hold,
    protocol.Stop: ParameterServer._on_stop,
    protocol.Shutdown: ParameterServer._on_shutdown,
    protocol.Attach: ParameterServer._on_attach,
    protocol.Pull: ParameterServer._on_pull,
    protocol.Rows: ParameterServer._on_rows,
    protocol.Lookup: ParameterServer._on_lookup,
    protocol.Push: ParameterServer._on_push,
    protocol.NonFinite: ParameterServer._on_nonfinite,
    protocol.Done: ParameterServer._on_done,
    protocol.Rejoin: ParameterServer._on_rejoin,
}
"""The handler of each request type of protocol.PSRequest (a test checks that every one has one)."""
