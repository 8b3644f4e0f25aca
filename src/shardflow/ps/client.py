"""The worker's side of the PS protocol: split gradients by placement, reassemble parameters, fetch and push only
the rows a batch uses of the row-sparse tables. The chief's requests are in ps/admin.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardflow import faults
from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.nn.lookups import TableLookups
from shardflow.nn.modules import tables
from shardflow.profile import spans
from shardflow.profile.recorder import flow_id, get_recorder
from shardflow.ps import protocol
from shardflow.ps.connection import PSConnection
from shardflow.ps.lanes import WorkerLane
from shardflow.ps.placement import Placement
from shardflow.ps.protocol import RejoinReply, StepReply
from shardflow.ps.rows import TableRows
from shardflow.ps.sparse import lookup_modules
from shardflow.ps.staging import HostStaging
from shardflow.ps.update_rules import all_finite
from shardflow.ps.worker_lanes import offer_lanes

__all__ = ["ParameterClient", "PushRequest", "Pushed", "Rejoined", "StepReply"]


@dataclass(frozen=True, kw_only=True)
class PushRequest:
    """What a worker's step pushes besides its gradients, handed by the worker to its client (see `begin_push`)."""

    input_state: dict[str, Any] | None = None
    """The worker's input position after the step's last batch: every PS keeps it with the step, so a restarted
    worker resumes after the last step all PS had, and ps:0's positions go into checkpoints."""
    learning_rate: float | None = None
    """The learning rate of this step, with a schedule that is a function of the step: the PS cannot run it."""
    nonfinite_loss: bool = False
    """The loss held NaN or inf, so backward never ran: every PS gets `NonFinite` in place of the gradients."""


@dataclass(frozen=True, kw_only=True)
class Pushed:
    """One step's requests in flight, one per PS (peer -> sequence number)."""

    requests: dict[str, int]
    base_step: int
    """The global step of the parameters the step was computed on."""
    nonfinite: str | None = None
    """Where this worker found NaN or inf ("loss", "gradients"), so it sent `NonFinite` in place of the pushes."""
    slots: dict[int, int | None]
    """Per PS: the lane push slot its gradients are in (None: frames), the PS's until it replies."""
    reply_slots: dict[int, int | None]
    """Per PS: the lane reply slot its reply's parameters go into (None: frames)."""


@dataclass(frozen=True, kw_only=True)
class Rejoined:
    """Where a starting worker stands with the PS: the steps of its earlier runs that every PS has, and the input
    position after them. A worker killed while pushing may have reached some PS with its last steps and not
    others: it repeats those steps from `input_state`, and the PS that had them answer without applying them."""

    local_step: int
    """The last of the worker's steps that every PS has; 0 for none (a first start)."""
    input_state: dict[str, Any] | None
    """The input position after that step; None for none."""
    ahead: int
    """How many of the steps after it some PS has already had."""
    generation: int
    """The lowest recovery generation among the PS (see protocol `Init`)."""


def _device_of(named: dict[str, torch.nn.Parameter]) -> torch.device:
    """The one device the model's parameters are on (the CPU for none)."""
    devices = {param.device for param in named.values()}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices ({sorted(map(str, devices))}); move it to one")
    return devices.pop() if devices else torch.device("cpu")


class ParameterClient(PSConnection):
    """Talks to every PS for one model replica: pushes its gradients and loads the parameters they send back,
    staged through host memory when the model is on a GPU (see ps/staging.py)."""

    def __init__(
        self,
        client: Client,
        ps_endpoints: Sequence[str],
        placement: Placement,
        model: torch.nn.Module,
        *,
        timeout_s: float = 60.0,
        worker_index: int = -1,
        interrupt: Callable[[], None] | None = None,
        wire_dtype: str | None = None,
    ) -> None:
        """`interrupt`: see PSConnection; the worker's raises once the chief restored the PS or ended the job.
        `wire_dtype`: "bf16" sends the float dense gradients and receives the float parameters in bfloat16 over the
        socket (ParameterServerStrategy.wire_dtype); None: as the PS keeps them."""
        if wire_dtype is not None and wire_dtype not in protocol.WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(protocol.WIRE_DTYPES)} or None, got {wire_dtype!r}")
        super().__init__(client, ps_endpoints, placement, model, timeout_s=timeout_s, interrupt=interrupt)
        self.wire_dtype = protocol.WIRE_DTYPES[wire_dtype] if wire_dtype is not None else None
        """What the requests name as their wire dtype; None: none."""
        # Per PS, the dtype each of its dense buffers travels in as frames.
        self._wire_dtypes = [
            [protocol.on_the_wire(getattr(torch, dtype), self.wire_dtype) for dtype in dtypes]
            for dtypes in self.layout.dtypes
        ]
        self.worker_index = worker_index
        self._role = f"worker:{worker_index}"
        self._index_of = {peer: k for k, peer in enumerate(self.peers)}
        self.staging = HostStaging(_device_of(self.named))
        self.rows = TableRows(self, self.staging)
        self.tables = TableLookups(self, model) if tables(model) else None
        """The lookups of the model's `sf.nn` tables; None: it has none."""
        # Per PS, once its pieces are complete: this step's tensors to check for NaN, its frames (on the host) and
        # frame counts.
        self._prepared: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[int]]] = {}
        self.lanes: list[WorkerLane | None] = [None] * placement.num_ps
        """Per PS: the shared-memory lane to it (see `attach_lanes`), or None: everything goes over the socket."""
        self._slots: list[int | None] = [None] * placement.num_ps
        self._slot_views: dict[tuple[int, int], list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
        """Per (PS, lane reply slot): each parameter's view of that slot, made on its first load."""
        self._pushed: Pushed | None = None
        self._hooks: list[Any] = []
        self._remaining: list[int] = []
        self._base_step = 0
        self._early: PushRequest | None = None
        """What the hooks push as soon as backward has produced every gradient; None: wait for `push`."""
        # Each PS's global step as its last reply said; a push to it carries that step as its base.
        self._ps_steps = [0] * placement.num_ps
        self._pull_after = [0] * placement.num_ps
        """Per PS, a global step the next pull waits for: the update that holds this worker's last step (`rejoin`)."""
        self.local_step = 0
        """This worker's steps so far, those of its earlier runs (restarts) included; see `rejoin`."""

    def fetch_rows(self, name: str, ids: torch.Tensor) -> None:
        """Write the current values of the rows `ids` of row-sparse variable `name` into the local weight, fetched
        from the PS that hold them; every other row of the local weight is stale."""
        self.rows.fetch(name, ids, self._base_step)

    def attach_lanes(self) -> None:
        """Offer each PS on this machine a shared-memory lane (ps/worker_lanes.py). Only for a model on the CPU: a
        GPU's tensors are staged through pinned memory of their own."""
        if self.staging.device.type == "cpu" and self.worker_index >= 0:
            self.lanes = offer_lanes(self, self.worker_index)

    def _load(self, replies: dict[int, Sequence[torch.Tensor]], slots: dict[int, int | None]) -> None:
        """Point each parameter at its slice of the received buffers, without a copy on the CPU (on a GPU, of
        their copies on it); a partitioned one is assembled from its pieces. The worker never writes parameters
        in place, so read-only frames serve. `slots`: per PS, the lane reply slot its buffers are (None: frames),
        whose views are made once and kept, since a slot's memory stays where it is."""
        assembled: dict[str, torch.Tensor] = {}
        for ps, buffers in replies.items():
            slot = slots.get(ps)
            views = self._slot_views.get((ps, slot)) if slot is not None else None
            if views is None:
                views, reusable = self._views(ps, self.staging.to_device(buffers), assembled)
                if slot is not None and reusable:
                    self._slot_views[ps, slot] = views
            for param, values in views:
                param.data = values
        for name, tensor in assembled.items():
            self.named[name].data = tensor

    def _views(
        self, ps: int, buffers: Sequence[torch.Tensor], assembled: dict[str, torch.Tensor]
    ) -> tuple[list[tuple[torch.nn.Parameter, torch.Tensor]], bool]:
        """Each whole parameter of `ps` with its view of `buffers`, the received dense buffers on the device; a
        partitioned piece is copied into its slice of `assembled`. And whether the views serve again for the same
        buffers: not when a piece was copied, or a buffer was cast from its wire dtype."""
        views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        reusable = True
        for dtype, received in zip(self.layout.dtypes[ps], buffers, strict=True):
            flat = received.to(getattr(torch, dtype))  # from the wire dtype (on the device: after the copy)
            reusable = reusable and flat is received
            for piece in self.layout.pieces[ps][dtype]:
                values = flat[piece.offset : piece.offset + piece.numel].view(piece.piece_shape)
                if piece.partitioned:
                    reusable = False
                    if piece.name not in assembled:
                        assembled[piece.name] = torch.empty(piece.shape, dtype=flat.dtype, device=flat.device)
                    assembled[piece.name][piece.row_start : piece.row_end] = values
                else:
                    views.append((self.named[piece.name], values))
        return views, reusable

    def _wait(
        self, peer_seqs: dict[str, int], op: str, load_params: bool, reply_slots: dict[int, int | None]
    ) -> StepReply:
        step, stop, nonfinite = 0, False, 0
        replies: dict[int, Sequence[torch.Tensor]] = {}
        loaded_slots: dict[int, int | None] = {}
        recorder = get_recorder()
        for peer, seq in peer_seqs.items():
            ps = self._index_of[peer]
            started = time.perf_counter_ns()
            header, tensors = self.recv(peer, seq)
            reply = StepReply.decode(header, op, peer)
            if reply.rows:  # the rows of a lookup that rode on the push (`TableLookups.ride`): its last frames
                rows, tensors = tensors[len(tensors) - reply.rows :], tensors[: len(tensors) - reply.rows]
                if self.tables is not None:
                    self.tables.push_replied(ps, seq, rows)
            self._ps_steps[ps] = reply.step
            lane, slot = self.lanes[ps], reply_slots.get(ps)
            if reply.lane:
                if lane is None or slot is None:
                    raise CommError(f"{peer} put its reply to {op!r} in a lane slot that was not asked for")
                tensors = lane.reply[slot]
            if recorder is not None:
                recorder.end(spans.PULL_WAIT, self._base_step, started, ps, sum(t.nbytes for t in tensors))
            if load_params and tensors:
                replies[ps] = tensors
                loaded_slots[ps] = slot if reply.lane else None
            if lane is not None and not (load_params and reply.lane):  # the slot asked for holds nothing in use
                lane.give_back_reply(slot)
            if ps == 0:
                step = reply.step
            stop = stop or reply.stop
            nonfinite = max(nonfinite, reply.nonfinite)
        if replies:
            self._load(replies, loaded_slots)
            for ps, slot in loaded_slots.items():
                if (lane := self.lanes[ps]) is not None:
                    lane.loaded_from(slot)
        return StepReply(step=step, stop=stop, nonfinite=nonfinite)

    def _take_reply_slots(self) -> dict[int, int | None]:
        """A free reply slot of each PS's lane for the parameters of the next reply (None: frames)."""
        return {ps: lane.take_reply() if lane is not None else None for ps, lane in enumerate(self.lanes)}

    def pull(self, min_step: int = 0) -> StepReply:
        """Fetch every PS's shards in parallel, once its global step is at least `min_step` (and, after a rejoin, has
        the update that holds this worker's last step), and load them into the model."""
        reply_slots = self._take_reply_slots()
        after, self._pull_after = self._pull_after, [0] * len(self.peers)
        seqs = {
            peer: self.client.send(
                peer,
                protocol.Pull(
                    min_step=max(min_step, after[ps]), reply_slot=reply_slots[ps], wire_dtype=self.wire_dtype
                ).header(),
            )
            for ps, peer in enumerate(self.peers)
        }
        return self._wait(seqs, protocol.Pull.op, load_params=True, reply_slots=reply_slots)

    def rejoin(self) -> Rejoined:
        """Ask every PS what it has of this worker's steps; `local_step` continues from the last all of them have."""
        replies = self.exchange([protocol.Rejoin(worker_index=self.worker_index)] * len(self.peers))
        rejoins = [RejoinReply.decode(h, peer) for (h, _), peer in zip(replies, self.peers, strict=True)]
        self._ps_steps = [r.step for r in rejoins]
        behind = min(rejoins, key=lambda r: r.local_step)
        # sync: the step this worker resumes after sits in a sum not applied yet; the next is computed on its update.
        # (A PS ahead holds the repeat of its step until then, as it held the first push.)
        self._pull_after = [r.step + 1 if r.in_sum and r.local_step == behind.local_step else 0 for r in rejoins]
        self.local_step = behind.local_step
        return Rejoined(
            local_step=behind.local_step,
            input_state=behind.input_state,
            ahead=max(r.local_step for r in rejoins) - behind.local_step,
            generation=min(r.generation for r in rejoins),
        )

    def begin_push(self, base_step: int, early: PushRequest | None = None) -> None:
        """Start a step on the parameters of global step `base_step` (as ps:0 counts it; the push to each PS
        carries that PS's step of the parameters it sent). With `early`, the hooks push it as soon as backward has
        produced every gradient and all of them are finite; without, nothing goes out before `push`, for a worker
        that changes the gradients after backward (accumulation, clipping) or learns its input position later."""
        self.local_step += 1
        self._early = early
        self._base_step = base_step
        self.rows.begin_step()
        if self.tables is not None:
            self.tables.begin_step()
        self._prepared = {}
        self._pushed = None
        self._slots = [lane.take_push() if lane is not None else None for lane in self.lanes]
        if not self._hooks:
            self._install_hooks()
        self._remaining = [len(self.placement.on_ps(k)) for k in range(self.placement.num_ps)]

    def _install_hooks(self) -> None:
        # On a GPU these hooks run on autograd's device thread, and may send: the main thread waits in backward()
        # meanwhile, so no two threads use a socket at once.
        pieces_of: dict[str, list[int]] = {}
        for piece in self.placement.pieces:
            pieces_of.setdefault(piece.name, []).append(piece.ps)
        for name, servers in pieces_of.items():

            def ready(_param: torch.Tensor, servers: list[int] = servers) -> None:
                if self._early is None:
                    return
                for ps in servers:
                    self._remaining[ps] -= 1
                    if self._remaining[ps] == 0:
                        self._prepare(ps)
                if not any(self._remaining):
                    self._send(self._early)

            self._hooks.append(self.named[name].register_post_accumulate_grad_hook(ready))
        # A sparse embedding fetches the rows it is about to look up, and only those.
        for name, modules in lookup_modules(self.model, list(self.layout.row_pieces)).items():

            def before_lookup(
                _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name
            ) -> None:
                self.fetch_rows(name, args[0] if args else kwargs["input"])

            for module in modules:
                self._hooks.append(module.register_forward_pre_hook(before_lookup, with_kwargs=True))

    def _prepare(self, ps: int) -> None:
        """Build `ps`'s frames once its pieces are complete; from a GPU, start their copies to the host."""
        if ps in self._prepared:
            return
        frames, counts = self.layout.dense_frames(ps, self.named, use_grads=True)
        lane, slot = self.lanes[ps], self._slots[ps]
        if lane is not None and slot is not None:
            # Into the lane's push slot, one buffer per dtype: the copy the PS makes of frames, made here instead.
            buffers, start = lane.push[slot], 0
            for buffer, count in zip(buffers, counts, strict=True):
                if count == 1:
                    buffer.copy_(frames[start])
                elif count:
                    torch.cat(frames[start : start + count], out=buffer)
                start += count
            rows = self.staging.to_host(self.rows.grad_frames(ps) + self._table_frames(ps))
            self._prepared[ps] = [*buffers, *rows], rows, [0] * len(counts)
            return
        frames = self.staging.to_host(
            self._cast(ps, frames, counts) + self.rows.grad_frames(ps) + self._table_frames(ps)
        )
        self._prepared[ps] = frames, frames, counts

    def _cast(self, ps: int, frames: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
        """`ps`'s dense frames in the dtypes they travel in (`wire_dtype`); on a GPU cast there, so the copy to the
        host moves the narrower bytes. Row-sparse and table rows always travel as the model holds them."""
        if self.wire_dtype is None:
            return frames
        cast, start = [], 0
        for wire, count in zip(self._wire_dtypes[ps], counts, strict=True):
            cast += [frame.to(wire) for frame in frames[start : start + count]]
            start += count
        return cast

    def _table_frames(self, ps: int) -> list[torch.Tensor]:
        return self.tables.grad_frames(ps) if self.tables is not None else []

    def assume_steps(self, step: int) -> None:
        """Every PS is at global step `step`, whatever its last reply said: a hybrid job's sync tables count the
        workers' own steps (train/hybrid_worker.py), and a reply to a repeated push may come before the step's
        update is applied."""
        self._ps_steps = [step] * len(self._ps_steps)

    def lookup_min_steps(self, overlapped: bool) -> list[int]:
        """Per PS, the global step a lookup sent ahead for the next step must wait for: the one this step's update
        makes, unless steps overlap (async: the next step is computed before this one is applied)."""
        return [0] * len(self._ps_steps) if overlapped else [step + 1 for step in self._ps_steps]

    def _send(self, request: PushRequest) -> None:
        """Send this step to every PS: the pushes, or `NonFinite` to each if the loss or any gradient held NaN or
        inf. All or none: a PS applies a push on arrival, so were ps:0 sent its finite pieces before ps:1's NaN was
        seen, their global steps would part for good. So the pushes wait until every PS's pieces are complete and
        checked, and every PS reaches one verdict, the worker's. One PS has none to share: it checks every push
        itself before applying it (ps/server.py), so the worker spares the pass over the gradients."""
        if self._pushed is not None:
            return
        nonfinite = "loss" if request.nonfinite_loss else None
        if nonfinite is None:
            for ps in range(len(self.peers)):
                self._prepare(ps)
            self.staging.wait_host()
            if len(self.peers) > 1 and not all(all_finite(checked) for checked, _, _ in self._prepared.values()):
                nonfinite = "gradients"
        recorder = get_recorder()
        requests: dict[str, int] = {}
        reply_slots = self._take_reply_slots()
        for ps, peer in enumerate(self.peers):
            started = time.perf_counter_ns()
            if nonfinite is not None:
                requests[peer] = self.client.send(peer, self._nonfinite(ps, nonfinite, request, reply_slots).header())
                continue
            pushed, frames, counts = self._prepared[ps]
            lookup, ids = self.tables.riding(ps) if self.tables is not None else ((), [])
            push = protocol.Push(
                worker_index=self.worker_index,
                local_step=self.local_step,
                base_step=self._ps_steps[ps],
                frame_counts=tuple(counts),
                input_state=request.input_state,
                lr=request.learning_rate,
                slot=self._slots[ps],
                reply_slot=reply_slots[ps],
                wire_dtype=self.wire_dtype,
                lookup=lookup,
            )
            sending = time.perf_counter_ns()  # the arrow starts before send(): the PS may apply it before that returns
            seq = requests[peer] = self.client.send(peer, push.header(), [*frames, *ids] if ids else frames)
            if ps == 0:
                faults.reached("push", self._role, self.local_step)
            if recorder is not None:
                recorder.flow(
                    spans.PUSH, self._base_step, flow_id(self.client.sender_id, seq), start=True, at_ns=sending
                )
                recorder.end(spans.PUSH, self._base_step, started, ps, sum(t.nbytes for t in pushed))  # lanes' too
        self._prepared = {}
        if self.tables is not None:  # no NonFinite carries a lookup: it goes on its own then
            self.tables.rode({self._index_of[peer]: seq for peer, seq in requests.items()} if nonfinite is None else {})
        # A NonFinite carries no gradients: its push slots are the PS's until it replies all the same, for brevity.
        slots = dict(enumerate(self._slots))
        self._pushed = Pushed(
            requests=requests, base_step=self._base_step, nonfinite=nonfinite, slots=slots, reply_slots=reply_slots
        )

    def _nonfinite(
        self, ps: int, found_in: str, request: PushRequest, reply_slots: dict[int, int | None]
    ) -> protocol.NonFinite:
        """What `ps` gets in place of this step's push when it held NaN or inf."""
        return protocol.NonFinite(
            worker_index=self.worker_index,
            local_step=self.local_step,
            base_step=self._ps_steps[ps],
            found_in=found_in,
            input_state=request.input_state,
            reply_slot=reply_slots[ps],
            wire_dtype=self.wire_dtype,
        )

    def push(self, request: PushRequest) -> Pushed:
        """Push this step to every PS, unless the hooks pushed the early request already (see `begin_push`);
        returns the requests. Variables without gradients push zeros, row-sparse ones no rows. If the loss or any
        gradient for any PS holds NaN or inf, every PS gets `NonFinite` instead."""
        self._send(request)
        assert self._pushed is not None
        return self._pushed

    def wait_push(self, pushed: Pushed, load_params: bool = True) -> StepReply:
        """Every PS's reply to a step's pushes; `nonfinite` is set when they were refused (see StepReply)."""
        op = protocol.Push.op if pushed.nonfinite is None else protocol.NonFinite.op
        reply = self._wait(pushed.requests, op, load_params=load_params, reply_slots=pushed.reply_slots)
        for ps, slot in pushed.slots.items():
            if (lane := self.lanes[ps]) is not None:
                lane.give_back_push(slot)
        return reply

    def done(self) -> None:
        """This worker has finished: the PS no longer wait for it."""
        try:
            self.broadcast(protocol.Done(worker_index=self.worker_index))
        except CommError:
            if self.interrupt is not None:
                self.interrupt()
            raise

    def close(self) -> None:
        """Remove the hooks, drop the lanes and close the sockets, dropping what they hold unsent: a request left
        queued for a PS that was lost would otherwise reach its restarted process, a slot of an old lane with it."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for lane in self.lanes:
            if lane is not None:
                lane.close()  # the model may still point into it: the mapping stays while it does
        self.lanes = [None] * len(self.lanes)
        self.client.close()
