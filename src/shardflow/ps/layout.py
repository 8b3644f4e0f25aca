"""Where each variable's pieces sit on the PS: dense pieces packed in one flat buffer per dtype, row-sparse
pieces as tables; and the frames that carry them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shardflow.ps.placement import Piece, Placement


class ShardLayout:
    """A placement seen per PS: its dtype buffers and the pieces packed in each, its tables, in wire order."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.num_ps = placement.num_ps
        self.dtypes: list[list[str]] = [list(placement.buffer_sizes(k)) for k in range(placement.num_ps)]
        """Per PS: the dtype of each of its dense buffers, in buffer order."""
        self.pieces: list[dict[str, list[Piece]]] = []
        """Per PS: the dense pieces packed into each dtype buffer, by offset."""
        for k in range(placement.num_ps):
            by_dtype: dict[str, list[Piece]] = {d: [] for d in self.dtypes[k]}
            for piece in placement.on_ps(k):
                if not piece.sparse:
                    by_dtype[piece.dtype].append(piece)
            for items in by_dtype.values():
                items.sort(key=lambda p: p.offset)
            self.pieces.append(by_dtype)
        self.tables: list[list[Piece]] = [placement.tables(k) for k in range(placement.num_ps)]
        """Per PS: its row-sparse tables, in the PS's order."""
        self.row_pieces: dict[str, list[tuple[Piece, int]]] = {}
        """Per row-sparse variable: its pieces by first row, each with its number among its PS's tables."""
        for tables in self.tables:
            for index, piece in enumerate(tables):
                self.row_pieces.setdefault(piece.name, []).append((piece, index))
        for pieces in self.row_pieces.values():
            pieces.sort(key=lambda item: item[0].row_start)

    def parts(self, ps: int) -> list[list[Piece]]:
        """The pieces of each tensor `ps` holds: one list per dtype buffer, then one per table."""
        return [self.pieces[ps][d] for d in self.dtypes[ps]] + [[table] for table in self.tables[ps]]

    def dense_frames(
        self, ps: int, named: Mapping[str, torch.nn.Parameter], use_grads: bool
    ) -> tuple[list[torch.Tensor], list[int]]:
        """The dense pieces for `ps` (values, or gradients: zeros where there is none) as separate zero-copy
        frames, dtype by dtype in offset order, and the count per dtype; the PS concatenates them, which keeps
        that copy off the worker's critical path."""
        frames: list[torch.Tensor] = []
        counts: list[int] = []
        for dtype in self.dtypes[ps]:
            pieces = self.pieces[ps][dtype]
            for piece in pieces:
                param = named[piece.name]
                source = param.grad if use_grads else param.detach()
                if source is None:
                    source = torch.zeros_like(param)
                if piece.partitioned:
                    source = source[piece.row_start : piece.row_end]
                frames.append(source.reshape(-1))
            counts.append(len(pieces))
        return frames, counts

    def table_frames(self, ps: int, named: Mapping[str, torch.nn.Parameter]) -> list[torch.Tensor]:
        """The values of each row-sparse table on `ps`, whole, one frame each."""
        frames = []
        for piece in self.tables[ps]:
            values = named[piece.name].detach()
            frames.append(values[piece.row_start : piece.row_end] if piece.partitioned else values)
        return frames

    def whole(self, ps_tensors: Sequence[Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every variable, a fresh tensor assembled from its pieces: `ps_tensors[k]` holds ps:k's dense buffers
        then its tables."""
        whole: dict[str, torch.Tensor] = {}
        for k, tensors in enumerate(ps_tensors):
            for pieces, tensor in zip(self.parts(k), tensors, strict=True):
                for piece in pieces:
                    values = tensor if piece.sparse else tensor[piece.offset : piece.offset + piece.numel]
                    put(whole, piece, values)
        return whole


def put(by_name: dict[str, torch.Tensor], piece: Piece, values: torch.Tensor) -> None:
    """Copy one piece's values into its whole variable in `by_name`, made on its first piece."""
    values = values.reshape(piece.piece_shape)
    if piece.name not in by_name:
        by_name[piece.name] = torch.empty(piece.shape, dtype=values.dtype)
    target = by_name[piece.name]
    (target[piece.row_start : piece.row_end] if piece.partitioned else target).copy_(values)
