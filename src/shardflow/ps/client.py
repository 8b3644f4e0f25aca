"""The worker's and chief's side of the PS protocol: split gradients by placement, reassemble parameters,
fetch and push only the rows a batch uses of the row-sparse tables, and the chief's requests."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardflow import faults
from shardflow.comm.client import Client
from shardflow.comm.errors import CommError, DeadlineExceeded
from shardflow.profile import spans
from shardflow.profile.recorder import flow_id, get_recorder
from shardflow.ps import protocol
from shardflow.ps.apply import all_finite
from shardflow.ps.lanes import LaneError, WorkerLane
from shardflow.ps.layout import ShardLayout
from shardflow.ps.placement import Placement
from shardflow.ps.protocol import RejoinReply, StatusReply, StepReply
from shardflow.ps.sparse import RowGrad, coalesced, lookup_modules, rows_between
from shardflow.ps.staging import HostStaging

log = logging.getLogger(__name__)

# How often a wait longer than this checks whether the PS were restored meanwhile.
_RESTORE_CHECK_S = 0.5

__all__ = ["ParameterClient", "Pushed", "Rejoined", "StatusReply", "StepReply", "read_global_step"]


def read_global_step(client: Client, peer: str, timeout_s: float) -> int:
    """The global step as `peer` (a PS, connected to `client`) counts it now."""
    header, _ = client.request(peer, protocol.Status().header(), timeout_s=timeout_s)
    return StatusReply.decode(header, peer).step


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


class ParameterClient:
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
    ) -> None:
        if len(ps_endpoints) != placement.num_ps:
            raise ValueError(f"placement is for {placement.num_ps} PS but {len(ps_endpoints)} addresses were given")
        self.client = client
        self.placement = placement
        self.timeout_s = timeout_s
        self.worker_index = worker_index
        self._role = f"worker:{worker_index}"
        self.peers = [f"ps:{k}" for k in range(placement.num_ps)]
        self._index_of = {peer: k for k, peer in enumerate(self.peers)}
        for peer, address in zip(self.peers, ps_endpoints, strict=True):
            client.connect(peer, address)
        named = dict(model.named_parameters())
        missing = [p.name for p in placement.pieces if p.name not in named]
        if missing:
            raise ValueError(f"the placement names variables the model lacks: {missing[:5]}")
        self.named = named
        self.staging = HostStaging(_device_of(named))
        self.layout = ShardLayout(placement)
        self._row_grads: dict[str, RowGrad] = {}
        # Per PS, once its pieces are complete: this step's tensors to check for NaN, its frames (on the host) and
        # frame counts.
        self._prepared: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[int]]] = {}
        self.lanes: list[WorkerLane | None] = [None] * placement.num_ps
        """Per PS: the shared-memory lane to it (see `attach_lanes`), or None: everything goes over the socket."""
        self._slots: list[int | None] = [None] * placement.num_ps
        self._pushed: Pushed | None = None
        self.model = model
        self._hooks: list[Any] = []
        self._remaining: list[int] = []
        self._base_step = 0
        self._step = 0
        self._push_early = True
        # Each PS's global step as its last reply said; a push to it carries that step as its base.
        self._ps_steps = [0] * placement.num_ps
        self.local_step = 0
        """This worker's steps so far, those of its earlier runs (restarts) included; see `rejoin`."""
        self.input_state: dict[str, Any] | None = None
        self.generation = 0
        """The recovery generation this client joined in (see protocol `Init`)."""
        self.check_restored: Callable[[], None] | None = None
        """Raises if the PS were restored since this client joined (set by the worker; see `_recv`)."""
        self.push_lr: float | None = None
        """The learning rate the next pushes carry, with a schedule that is a function of the step."""

    # -- moving tensors ---------------------------------------------------------------------------

    def _row_grad_frames(self, ps: int) -> list[torch.Tensor]:
        """For each row-sparse table on `ps`, the rows of it this step's gradient touches (numbered from the
        table's first row) and their gradient, summed over duplicates: two frames per table, maybe empty."""
        frames: list[torch.Tensor] = []
        for piece in self.layout.tables[ps]:
            if piece.name not in self._row_grads:
                rows, values = coalesced(piece.name, self.named[piece.name])
                self._row_grads[piece.name] = rows.cpu(), values  # the rows are cut on the host
            rows, values = self._row_grads[piece.name]
            ((begin, end),) = rows_between(rows, [piece.row_start], piece.row_end)
            frames += [rows[begin:end] - piece.row_start, values[begin:end]]
        return frames

    def fetch_rows(self, name: str, ids: torch.Tensor) -> None:
        """Write the current values of the rows `ids` of row-sparse variable `name` into the local weight, fetched
        from the PS that hold them, in parallel; every other row of the local weight is stale."""
        rows = torch.unique(ids.detach().reshape(-1).cpu())
        pieces = self.layout.row_pieces[name]
        weight = self.named[name]
        if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= weight.shape[0]):
            raise ValueError(
                f"{name!r} has {weight.shape[0]} rows; the batch looks up rows {int(rows[0])}..{int(rows[-1])}"
            )
        bounds = rows_between(rows, [piece.row_start for piece, _ in pieces], weight.shape[0])
        requests: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        for (piece, index), (begin, end) in zip(pieces, bounds, strict=True):
            if begin < end:
                tables, frames = requests.setdefault(piece.ps, ([], []))
                tables.append(index)
                frames.append(rows[begin:end] - piece.row_start)
        seqs = {
            ps: self.client.send(self.peers[ps], protocol.Rows(table_indices=tuple(tables)).header(), frames)
            for ps, (tables, frames) in requests.items()
        }
        recorder = get_recorder()
        with torch.no_grad():
            for ps, seq in seqs.items():
                started = time.perf_counter_ns()
                header, values = self._recv(self.peers[ps], seq)
                StepReply.decode(header, protocol.Rows.op, self.peers[ps])
                if recorder is not None:
                    recorder.end(spans.PULL_WAIT, self._step, started, ps, sum(v.nbytes for v in values))
                tables, frames = requests[ps]
                moved = zip(tables, self.staging.to_device(frames), self.staging.to_device(values), strict=True)
                for index, local_rows, rows_values in moved:
                    piece = self.layout.tables[ps][index]
                    weight.index_copy_(0, local_rows + piece.row_start, rows_values)

    def _recv(self, peer: str, seq: int, timeout_s: float | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """A wait for a reply: within the request deadline (default timeout_s), and cut short (by whatever
        `check_restored` raises) once a PS was restarted or the PS restored, since a lost PS never answers."""
        timeout_s = timeout_s or self.timeout_s
        if self.check_restored is None:
            return self.client.recv(peer, seq, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            slice_s = min(_RESTORE_CHECK_S, deadline - time.monotonic())
            try:
                return self.client.recv(peer, seq, max(slice_s, 0.0))
            except DeadlineExceeded as expired:
                self.check_restored()
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(peer, expired.address, expired.what, timeout_s) from None
            except CommError:
                self.check_restored()  # a PS refuses a push of the training before its restore
                raise

    def attach_lanes(self) -> None:
        """Offer each PS that this process reaches over a UNIX socket (so on this machine) a shared-memory lane
        (ps/lanes.py); a PS that cannot map it, or a lane that cannot be made, leaves that PS on the socket, said in
        one line. Only for a model on the CPU: a GPU's tensors are staged through pinned memory of their own."""
        if self.staging.device.type != "cpu" or self.worker_index < 0:
            return
        requests: dict[int, tuple[WorkerLane, int]] = {}
        for ps, peer in enumerate(self.peers):
            if not self.client.address(peer).startswith("ipc://"):
                continue
            buffers = [(getattr(torch, dtype), numel) for dtype, numel in self.placement.buffer_sizes(ps).items()]
            if not any(numel for _, numel in buffers):
                continue
            try:
                lane = WorkerLane(buffers)
            except LaneError as error:
                log.warning(
                    "%s cannot make a shared-memory lane to %s (%s); it uses the socket", self._role, peer, error
                )
                continue
            attach = protocol.Attach(
                worker_index=self.worker_index,
                pid=os.getpid(),
                fd=lane.fd,
                push_slots=lane.push_slots,
                reply_slots=lane.reply_slots,
            )
            requests[ps] = lane, self.client.send(peer, attach.header())
        for ps, (lane, seq) in requests.items():
            try:
                self._recv(self.peers[ps], seq)
            except CommError as error:
                log.warning("%s: %s; it uses the socket", self._role, error)
                lane.close()
                continue
            self.lanes[ps] = lane

    def _load(self, replies: dict[int, Sequence[torch.Tensor]]) -> None:
        """Point each parameter at its slice of the received buffers, without a copy on the CPU (on a GPU, of
        their copies on it); a partitioned one is assembled from its pieces. The worker never writes parameters
        in place, so read-only frames serve."""
        assembled: dict[str, torch.Tensor] = {}
        for ps, buffers in replies.items():
            for dtype, flat in zip(self.layout.dtypes[ps], self.staging.to_device(buffers), strict=True):
                for piece in self.layout.pieces[ps][dtype]:
                    values = flat[piece.offset : piece.offset + piece.numel].view(piece.piece_shape)
                    if piece.partitioned:
                        if piece.name not in assembled:
                            assembled[piece.name] = torch.empty(piece.shape, dtype=flat.dtype, device=flat.device)
                        assembled[piece.name][piece.row_start : piece.row_end] = values
                    else:
                        self.named[piece.name].data = values
        for name, tensor in assembled.items():
            self.named[name].data = tensor

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
            header, tensors = self._recv(peer, seq)
            reply = StepReply.decode(header, op, peer)
            self._ps_steps[ps] = reply.step
            lane, slot = self.lanes[ps], reply_slots.get(ps)
            if reply.lane:
                if lane is None or slot is None:
                    raise CommError(f"{peer} put its reply to {op!r} in a lane slot that was not asked for")
                tensors = lane.reply[slot]
            if recorder is not None:
                recorder.end(spans.PULL_WAIT, self._step, started, ps, sum(t.nbytes for t in tensors))
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
            self._load(replies)
            for ps, slot in loaded_slots.items():
                if (lane := self.lanes[ps]) is not None:
                    lane.loaded_from(slot)
        return StepReply(step=step, stop=stop, nonfinite=nonfinite)

    def _take_reply_slots(self) -> dict[int, int | None]:
        """A free reply slot of each PS's lane for the parameters of the next reply (None: frames)."""
        return {ps: lane.take_reply() if lane is not None else None for ps, lane in enumerate(self.lanes)}

    # -- chief (see train/checkpoints/servers.py for state) -------------------------------------

    def exchange(
        self,
        messages: Sequence[protocol.PSRequest],
        frames: Sequence[Sequence[torch.Tensor]] | None = None,
        timeout_s: float | None = None,
    ) -> list[tuple[dict[str, Any], list[torch.Tensor]]]:
        """Send ps:k `messages[k]` (with `frames[k]`), all in parallel; their replies' headers and frames, in PS
        order. A PS that answers with an error raises CommError."""
        if len(messages) != len(self.peers):
            raise ValueError(f"{len(messages)} messages for {len(self.peers)} PS")
        seqs = [
            self.client.send(peer, message.header(), frames[k] if frames is not None else ())
            for k, (peer, message) in enumerate(zip(self.peers, messages, strict=True))
        ]
        return [self._recv(peer, seq, timeout_s) for peer, seq in zip(self.peers, seqs, strict=True)]

    def _broadcast(self, message: protocol.PSRequest) -> list[StepReply]:
        replies = self.exchange([message] * len(self.peers))
        return [StepReply.decode(h, message.op, peer) for (h, _), peer in zip(replies, self.peers, strict=True)]

    def status(self, timeout_s: float | None = None) -> list[StatusReply]:
        """Every PS's global step, snapshots held and counters, in PS order."""
        replies = self.exchange([protocol.Status()] * len(self.peers), timeout_s=timeout_s)
        return [StatusReply.decode(h, peer) for (h, _), peer in zip(replies, self.peers, strict=True)]

    def snapshot_at(self, step: int) -> None:
        """Every PS snapshots its state when the global step reaches `step`."""
        self._broadcast(protocol.SnapshotAt(step=step))

    def release_snapshots(self, through_step: int) -> None:
        """The snapshots up to `through_step` are saved; the PS may drop them."""
        self._broadcast(protocol.ReleaseSnapshots(through_step=through_step))

    def lost(self, worker_index: int) -> None:
        """Steps complete without this worker until it rejoins (lost_worker_policy "continue")."""
        self._broadcast(protocol.Lost(worker_index=worker_index))

    def stop(self) -> None:
        """End training at the current step: every PS drops later pushes and tells the workers to stop."""
        self._broadcast(protocol.Stop())

    def shutdown(self) -> None:
        self._broadcast(protocol.Shutdown())

    # -- worker ---------------------------------------------------------------------------------

    def global_step(self) -> int:
        return read_global_step(self.client, self.peers[0], self.timeout_s)

    def pull(self, min_step: int = 0) -> StepReply:
        """Fetch every PS's shards in parallel and load them into the model."""
        reply_slots = self._take_reply_slots()
        seqs = {
            peer: self.client.send(peer, protocol.Pull(min_step=min_step, reply_slot=reply_slots[ps]).header())
            for ps, peer in enumerate(self.peers)
        }
        return self._wait(seqs, protocol.Pull.op, load_params=True, reply_slots=reply_slots)

    def rejoin(self) -> Rejoined:
        """Ask every PS what it has of this worker's steps; `local_step` continues from the last all of them have."""
        replies = self.exchange([protocol.Rejoin(worker_index=self.worker_index)] * len(self.peers))
        rejoins = [RejoinReply.decode(h, peer) for (h, _), peer in zip(replies, self.peers, strict=True)]
        self._ps_steps = [r.step for r in rejoins]
        behind = min(rejoins, key=lambda r: r.local_step)
        self.local_step = behind.local_step
        return Rejoined(
            local_step=behind.local_step,
            input_state=behind.input_state,
            ahead=max(r.local_step for r in rejoins) - behind.local_step,
            generation=min(r.generation for r in rejoins),
        )

    def begin_push(self, base_step: int, *, push_early: bool = True) -> None:
        """Start a step on the parameters of global step `base_step` (as ps:0 counts it; the push to each PS
        carries that PS's step of the parameters it sent): the pushes go out as soon as backward has produced
        every gradient and all of them are finite; see `end_push`. Without `push_early` they wait for `end_push`,
        for a worker that changes the gradients after backward (accumulation, clipping)."""
        self.local_step += 1
        self._push_early = push_early
        self._base_step = self._step = base_step
        self._row_grads = {}
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
                if not self._push_early:
                    return
                for ps in servers:
                    self._remaining[ps] -= 1
                    if self._remaining[ps] == 0:
                        self._prepare(ps)
                if not any(self._remaining):
                    self._send()

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
            rows = self._row_grad_frames(ps)
            self._prepared[ps] = [*buffers, *rows], rows, [0] * len(counts)
            return
        frames = self.staging.to_host(frames + self._row_grad_frames(ps))
        self._prepared[ps] = frames, frames, counts

    def _send(self, nonfinite: str | None = None) -> None:
        """Send this step to every PS: the pushes, or `NonFinite` to each if the loss or any gradient held NaN or
        inf. All or none: a PS applies a push on arrival, and the PS hold disjoint shards, so were ps:0 sent its
        finite pieces before ps:1's NaN was seen, ps:0 would apply a step that ps:1 refuses, and their global
        steps would part for good. So the pushes wait until every PS's pieces are complete and checked (with
        one PS, as before: its pieces complete last), and every PS reaches the same verdict, the worker's."""
        if self._pushed is not None:
            return
        if nonfinite is None:
            for ps in range(len(self.peers)):
                self._prepare(ps)
            self.staging.wait_host()
            if not all(all_finite(checked) for checked, _, _ in self._prepared.values()):
                nonfinite = "gradients"
        recorder = get_recorder()
        requests: dict[str, int] = {}
        reply_slots = self._take_reply_slots()
        for ps, peer in enumerate(self.peers):
            # Every PS keeps each worker's input position with the step it belongs to: a restarted worker resumes
            # after the last step all PS had, and ps:0's positions go into checkpoints.
            input_state = self.input_state
            started = time.perf_counter_ns()
            if nonfinite is not None:
                message = protocol.NonFinite(
                    worker_index=self.worker_index,
                    local_step=self.local_step,
                    base_step=self._ps_steps[ps],
                    found_in=nonfinite,
                    input_state=input_state,
                    reply_slot=reply_slots[ps],
                )
                requests[peer] = self.client.send(peer, message.header())
                continue
            pushed, frames, counts = self._prepared[ps]
            push = protocol.Push(
                worker_index=self.worker_index,
                local_step=self.local_step,
                base_step=self._ps_steps[ps],
                frame_counts=tuple(counts),
                input_state=input_state,
                lr=self.push_lr,
                slot=self._slots[ps],
                reply_slot=reply_slots[ps],
            )
            sending = time.perf_counter_ns()  # the arrow starts before send(): the PS may apply it before that returns
            seq = requests[peer] = self.client.send(peer, push.header(), frames)
            if ps == 0:
                faults.reached("push", self._role, self.local_step)
            if recorder is not None:
                recorder.flow(spans.PUSH, self._step, flow_id(self.client.sender_id, seq), start=True, at_ns=sending)
                recorder.end(spans.PUSH, self._step, started, ps, sum(t.nbytes for t in pushed))  # lanes' too
        self._prepared = {}
        # A NonFinite carries no gradients: its push slots are the PS's until it replies all the same, for brevity.
        slots = dict(enumerate(self._slots))
        self._pushed = Pushed(
            requests=requests, base_step=self._base_step, nonfinite=nonfinite, slots=slots, reply_slots=reply_slots
        )

    def end_push(self) -> Pushed:
        """Push what the hooks have not sent (variables without gradients push zeros, row-sparse ones no rows);
        returns the requests. If any gradient for any PS holds NaN or inf, every PS gets `NonFinite` instead."""
        self._send()
        assert self._pushed is not None
        return self._pushed

    def push_nonfinite_loss(self) -> Pushed:
        """In place of backward and `end_push`: the loss held NaN or inf, so every PS gets `NonFinite`."""
        self._send(nonfinite="loss")
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
            self._broadcast(protocol.Done(worker_index=self.worker_index))
        except CommError:
            if self.check_restored is not None:
                self.check_restored()
            raise

    def reconnect(self, ps_endpoints: Sequence[str]) -> None:
        """Connect to every PS again, at these addresses (a restarted PS may serve elsewhere); requests in flight
        are forgotten."""
        for peer, address in zip(self.peers, ps_endpoints, strict=True):
            self.client.connect(peer, address)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for lane in self.lanes:
            if lane is not None:
                lane.close()  # the model may still point into it: the mapping stays while it does
        self.lanes = [None] * len(self.lanes)
