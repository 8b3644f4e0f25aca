"""The worker's and chief's side of the PS protocol: split gradients by placement, reassemble parameters, and
fetch and push only the rows a batch uses of the row-sparse tables."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardflow.comm.client import Client
from shardflow.profile.recorder import flow_id, get_recorder
from shardflow.ps.placement import Piece, Placement
from shardflow.ps.sparse import RowGrad, coalesced, lookup_modules, rows_between


@dataclass(frozen=True)
class StepReply:
    """What the PS answered to one push or pull: the global step after it, and whether training is over."""

    step: int
    stop: bool


class ParameterClient:
    """Talks to every PS for one model replica: pushes its gradients and loads the parameters they send back."""

    def __init__(
        self,
        client: Client,
        ps_endpoints: Sequence[tuple[str, bytes | None]],
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
        self.peers = [f"ps:{k}" for k in range(placement.num_ps)]
        # A PS that is not on loopback encrypts (CURVE); its key came with its address.
        for peer, (address, server_key) in zip(self.peers, ps_endpoints, strict=True):
            client.connect(peer, address, server_key=server_key)
        named = dict(model.named_parameters())
        missing = [p.name for p in placement.pieces if p.name not in named]
        if missing:
            raise ValueError(f"the placement names variables the model lacks: {missing[:5]}")
        self.named = named
        # Per PS: its dtype buffers in a fixed order, and the dense pieces packed into each, by offset.
        self.dtypes: list[list[str]] = [list(placement.buffer_sizes(k)) for k in range(placement.num_ps)]
        self.pieces: list[dict[str, list[Piece]]] = []
        for k in range(placement.num_ps):
            by_dtype: dict[str, list[Piece]] = {d: [] for d in self.dtypes[k]}
            for piece in placement.on_ps(k):
                if not piece.sparse:
                    by_dtype[piece.dtype].append(piece)
            for items in by_dtype.values():
                items.sort(key=lambda p: p.offset)
            self.pieces.append(by_dtype)
        # Per PS: its row-sparse tables in the PS's order; per row-sparse variable: its pieces by first row, each
        # with its number among its PS's tables.
        self.tables: list[list[Piece]] = [placement.tables(k) for k in range(placement.num_ps)]
        self.row_pieces: dict[str, list[tuple[Piece, int]]] = {}
        for tables in self.tables:
            for index, piece in enumerate(tables):
                self.row_pieces.setdefault(piece.name, []).append((piece, index))
        for pieces in self.row_pieces.values():
            pieces.sort(key=lambda item: item[0].row_start)
        self._row_grads: dict[str, RowGrad] = {}
        self._pending: dict[str, int] = {}
        self.model = model
        self._hooks: list[Any] = []
        self._remaining: list[int] = []
        self._push_header: dict[str, Any] = {}
        self._step = 0
        self.input_state: dict[str, Any] | None = None

    # -- moving tensors ---------------------------------------------------------------------------

    def _frames(self, ps: int, use_grads: bool) -> tuple[list[torch.Tensor], list[int]]:
        """The dense pieces for `ps` as separate zero-copy frames, dtype by dtype in offset order, and the count per
        dtype; the PS concatenates them, which keeps that copy off the worker's critical path."""
        frames: list[torch.Tensor] = []
        counts: list[int] = []
        for dtype in self.dtypes[ps]:
            pieces = self.pieces[ps][dtype]
            for piece in pieces:
                param = self.named[piece.name]
                source = param.grad if use_grads else param.detach()
                if source is None:
                    source = torch.zeros_like(param)
                if piece.partitioned:
                    source = source[piece.row_start : piece.row_end]
                frames.append(source.reshape(-1))
            counts.append(len(pieces))
        return frames, counts

    def _table_frames(self, ps: int) -> list[torch.Tensor]:
        """The values of each row-sparse table on `ps`, whole (to initialise it), one frame each."""
        frames = []
        for piece in self.tables[ps]:
            values = self.named[piece.name].detach()
            frames.append(values[piece.row_start : piece.row_end] if piece.partitioned else values)
        return frames

    def _row_grad_frames(self, ps: int) -> list[torch.Tensor]:
        """For each row-sparse table on `ps`, the rows of it this step's gradient touches (numbered from the
        table's first row) and their gradient, summed over duplicates: two frames per table, maybe empty."""
        frames: list[torch.Tensor] = []
        for piece in self.tables[ps]:
            if piece.name not in self._row_grads:
                self._row_grads[piece.name] = coalesced(piece.name, self.named[piece.name])
            rows, values = self._row_grads[piece.name]
            ((begin, end),) = rows_between(rows, [piece.row_start], piece.row_end)
            frames += [rows[begin:end] - piece.row_start, values[begin:end]]
        return frames

    def fetch_rows(self, name: str, ids: torch.Tensor) -> None:
        """Write the current values of the rows `ids` of row-sparse variable `name` into the local weight, fetched
        from the PS that hold them, in parallel; every other row of the local weight is stale."""
        rows = torch.unique(ids.detach().reshape(-1).cpu())
        pieces = self.row_pieces[name]
        weight = self.named[name]
        if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= weight.shape[0]):
            raise ValueError(
                f"{name!r} has {weight.shape[0]} rows; the batch looks up rows {int(rows[0])}..{int(rows[-1])}"
            )
        spans = rows_between(rows, [piece.row_start for piece, _ in pieces], weight.shape[0])
        requests: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        for (piece, index), (begin, end) in zip(pieces, spans, strict=True):
            if begin < end:
                tables, frames = requests.setdefault(piece.ps, ([], []))
                tables.append(index)
                frames.append(rows[begin:end] - piece.row_start)
        seqs = {
            ps: self.client.send(self.peers[ps], {"op": "rows", "tables": tables}, frames)
            for ps, (tables, frames) in requests.items()
        }
        recorder = get_recorder()
        with torch.no_grad():
            for ps, seq in seqs.items():
                started = time.perf_counter_ns()
                _, values = self.client.recv(self.peers[ps], seq, self.timeout_s)
                if recorder is not None:
                    recorder.end("pull_wait", self._step, started, ps, sum(v.nbytes for v in values))
                tables, frames = requests[ps]
                for index, local_rows, rows_values in zip(tables, frames, values, strict=True):
                    piece = self.tables[ps][index]
                    weight.index_copy_(0, local_rows + piece.row_start, rows_values.to(weight.device))

    def _load(self, replies: dict[int, Sequence[torch.Tensor]]) -> None:
        """Point each parameter at its slice of the received buffers, without a copy; a partitioned one is
        assembled from its pieces. The worker never writes parameters in place, so read-only frames serve."""
        assembled: dict[str, torch.Tensor] = {}
        for ps, buffers in replies.items():
            for dtype, flat in zip(self.dtypes[ps], buffers, strict=True):
                for piece in self.pieces[ps][dtype]:
                    values = flat[piece.offset : piece.offset + piece.numel].view(piece.piece_shape)
                    if piece.partitioned:
                        if piece.name not in assembled:
                            assembled[piece.name] = torch.empty(piece.shape, dtype=flat.dtype)
                        assembled[piece.name][piece.row_start : piece.row_end] = values
                    else:
                        self.named[piece.name].data = values
        for name, tensor in assembled.items():
            self.named[name].data = tensor

    def _wait(self, peer_seqs: dict[str, int], load_params: bool) -> StepReply:
        step, stop = 0, False
        replies: dict[int, Sequence[torch.Tensor]] = {}
        recorder = get_recorder()
        for peer, seq in peer_seqs.items():
            started = time.perf_counter_ns()
            header, tensors = self.client.recv(peer, seq, self.timeout_s)
            if recorder is not None:
                recorder.end("pull_wait", self._step, started, int(peer[3:]), sum(t.nbytes for t in tensors))
            if load_params and tensors:
                replies[int(peer.split(":")[1])] = tensors
            if peer == "ps:0":
                step = int(header["step"])
            stop = stop or bool(header.get("stop"))
        if replies:
            self._load(replies)
        return StepReply(step, stop)

    # -- chief (see ps/checkpointing.py for state) ------------------------------------------------

    def broadcast(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        """Send one small request to every PS and return their reply headers, in PS order."""
        seqs = {peer: self.client.send(peer, dict(header)) for peer in self.peers}
        return [self.client.recv(peer, seq, self.timeout_s)[0] for peer, seq in seqs.items()]

    def shutdown(self) -> None:
        self.broadcast({"op": "shutdown"})

    # -- worker ---------------------------------------------------------------------------------

    def global_step(self) -> int:
        header, _ = self.client.request("ps:0", {"op": "step"}, timeout_s=self.timeout_s)
        return int(header["step"])

    def pull(self, min_step: int = 0) -> StepReply:
        """Fetch every PS's shards in parallel and load them into the model."""
        seqs = {peer: self.client.send(peer, {"op": "pull", "min_step": min_step}) for peer in self.peers}
        return self._wait(seqs, load_params=True)

    def begin_push(self, header: dict[str, Any], step: int = 0) -> None:
        """Start a step: each PS's gradients are pushed as soon as backward has produced all of them."""
        self._push_header = {"op": "push", "w": self.worker_index, **header}
        self._step = step
        self._pending = {}
        self._row_grads = {}
        if not self._hooks:
            self._install_hooks()
        self._remaining = [len(self.placement.on_ps(k)) for k in range(self.placement.num_ps)]

    def _install_hooks(self) -> None:
        pieces_of: dict[str, list[int]] = {}
        for piece in self.placement.pieces:
            pieces_of.setdefault(piece.name, []).append(piece.ps)
        for name, servers in pieces_of.items():

            def ready(_param: torch.Tensor, servers: list[int] = servers) -> None:
                for ps in servers:
                    self._remaining[ps] -= 1
                    if self._remaining[ps] == 0:
                        self._send_push(ps)

            self._hooks.append(self.named[name].register_post_accumulate_grad_hook(ready))
        # A sparse embedding fetches the rows it is about to look up, and only those.
        for name, modules in lookup_modules(self.model, list(self.row_pieces)).items():

            def before_lookup(
                _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name
            ) -> None:
                self.fetch_rows(name, args[0] if args else kwargs["input"])

            for module in modules:
                self._hooks.append(module.register_forward_pre_hook(before_lookup, with_kwargs=True))

    def _send_push(self, ps: int) -> None:
        peer = self.peers[ps]
        if peer not in self._pending:
            recorder = get_recorder()
            started = time.perf_counter_ns()
            frames, counts = self._frames(ps, use_grads=True)
            frames += self._row_grad_frames(ps)
            header = {**self._push_header, "n": counts}
            if ps == 0 and self.input_state is not None:
                # ps:0 keeps each worker's input position with the update it belongs to, for checkpoints.
                header["it"] = self.input_state
            seq = self.client.send(peer, header, frames)
            self._pending[peer] = seq
            if recorder is not None:
                recorder.flow("push", self._step, flow_id(self.client.sender_id, seq), start=True)
                recorder.end("push", self._step, started, ps, sum(f.nbytes for f in frames))

    def end_push(self) -> dict[str, int]:
        """Push what the hooks have not sent (variables without gradients push zeros, row-sparse ones no rows);
        returns the requests."""
        for ps in range(len(self.peers)):
            self._send_push(ps)
        return dict(self._pending)

    def wait_push(self, requests: dict[str, int], load_params: bool = True) -> StepReply:
        return self._wait(requests, load_params=load_params)

    def done(self) -> None:
        self.broadcast({"op": "done", "w": self.worker_index})

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
