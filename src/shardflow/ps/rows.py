"""The worker's side of the row-sparse tables (ps/sparse.py): fetch the rows a batch looks up just before its
lookup, and push only the rows its gradient touches."""

from __future__ import annotations

import time

import torch

from shardflow.profile import spans
from shardflow.profile.recorder import get_recorder
from shardflow.ps import protocol
from shardflow.ps.connection import PSConnection
from shardflow.ps.protocol import StepReply
from shardflow.ps.sparse import RowGrad, coalesced, rows_between
from shardflow.ps.staging import HostStaging


class TableRows:
    """The rows of every row-sparse table that one step of this worker reads and writes."""

    def __init__(self, connection: PSConnection, staging: HostStaging) -> None:
        self.connection = connection
        self.staging = staging
        self._row_grads: dict[str, RowGrad] = {}

    def begin_step(self) -> None:
        self._row_grads = {}

    def grad_frames(self, ps: int) -> list[torch.Tensor]:
        """For each row-sparse table on `ps`, the rows of it this step's gradient touches (numbered from the
        table's first row) and their gradient, summed over duplicates: two frames per table, maybe empty."""
        named = self.connection.named
        frames: list[torch.Tensor] = []
        for piece in self.connection.layout.tables[ps]:
            if piece.name not in self._row_grads:
                rows, values = coalesced(piece.name, named[piece.name])
                self._row_grads[piece.name] = rows.cpu(), values  # the rows are cut on the host
            rows, values = self._row_grads[piece.name]
            ((begin, end),) = rows_between(rows, [piece.row_start], piece.row_end)
            frames += [rows[begin:end] - piece.row_start, values[begin:end]]
        return frames

    def fetch(self, name: str, ids: torch.Tensor, step: int) -> None:
        """Write the current values of the rows `ids` of row-sparse variable `name` into the local weight, fetched
        from the PS that hold them, in parallel; every other row of the local weight is stale. `step`: the global
        step the wait is recorded at."""
        connection, layout = self.connection, self.connection.layout
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"the sparse embedding of {name!r} looks up ids of {ids.dtype}: cast them with .long()")
        # int32 ids (what make_csv_dataset infers) are as good as int64 to torch: the PS takes int64 row numbers.
        rows = torch.unique(ids.detach().reshape(-1).cpu().to(torch.int64))
        pieces = layout.row_pieces[name]
        weight = connection.named[name]
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
        peers = connection.peers
        seqs = {
            ps: connection.client.send(peers[ps], protocol.Rows(table_indices=tuple(tables)).header(), frames)
            for ps, (tables, frames) in requests.items()
        }
        recorder = get_recorder()
        with torch.no_grad():
            for ps, seq in seqs.items():
                started = time.perf_counter_ns()
                header, values = connection.recv(peers[ps], seq)
                StepReply.decode(header, protocol.Rows.op, peers[ps])
                if recorder is not None:
                    recorder.end(spans.PULL_WAIT, step, started, ps, sum(v.nbytes for v in values))
                tables, frames = requests[ps]
                moved = zip(tables, self.staging.to_device(frames), self.staging.to_device(values), strict=True)
                for index, local_rows, rows_values in moved:
                    piece = layout.tables[ps][index]
                    weight.index_copy_(0, local_rows + piece.row_start, rows_values)
