"""Placement: dim-0 partitioning and greedy-by-size balance across PS."""

import pytest
import torch

from shardflow.ps.placement import Partitioner, Placement, place


def _variables(*shapes):
    return [(f"v{i}", torch.zeros(shape)) for i, shape in enumerate(shapes)]


def test_placement_balances_bytes_across_ps():
    variables = _variables((1000, 64), (512, 512), (512,), (64, 10), (300, 300), (10,), (2000, 8), (128, 128))
    placement = place(variables, num_ps=3, partitioner=Partitioner(min_slice_bytes=1 << 30))
    loads = placement.bytes_per_ps()
    largest_piece = max(p.numel * 4 for p in placement.pieces)
    # Greedy-by-size: no PS exceeds the lightest by more than one (the largest) piece.
    assert max(loads) - min(loads) <= largest_piece
    assert sum(loads) == sum(t.numel() * 4 for _, t in variables)


def test_partitioning_evens_out_a_model_dominated_by_one_tensor():
    variables = _variables((4096, 256), (256,), (256, 10))
    placement = place(variables, num_ps=4, partitioner=Partitioner(min_slice_bytes=64 << 10))
    loads = placement.bytes_per_ps()
    assert max(loads) / min(loads) < 1.05
    slices = [p for p in placement.pieces if p.name == "v0"]
    assert len(slices) == 4
    assert [(p.row_start, p.row_end) for p in slices] == [
        (0, 1024),
        (1024, 2048),
        (2048, 3072),
        (3072, 4096),
    ]
    assert sorted(p.ps for p in slices) == [0, 1, 2, 3]


def test_min_slice_bytes_limits_the_number_of_slices():
    # 1 MiB tensor, 256 KiB minimum slice: at most 4 slices even with 8 PS.
    placement = place(_variables((1024, 256)), num_ps=8, partitioner=Partitioner(min_slice_bytes=256 << 10))
    assert len(placement.pieces) == 4


def test_fixed_shards_cut_every_tensor_with_enough_rows():
    placement = place(_variables((10, 3), (2, 3), (7,)), num_ps=2, partitioner=Partitioner(fixed_shards=3))
    counts = {name: sum(p.name == name for p in placement.pieces) for name in ("v0", "v1", "v2")}
    assert counts == {"v0": 3, "v1": 2, "v2": 3}


def test_offsets_pack_each_ps_buffer_without_gaps_or_overlap():
    placement = place(_variables((100, 7), (33,), (5, 5), ()), num_ps=2, partitioner=Partitioner(fixed_shards=2))
    for ps in range(2):
        pieces = sorted(placement.on_ps(ps), key=lambda p: p.offset)
        position = 0
        for piece in pieces:
            assert piece.offset == position
            position += piece.numel
        assert placement.buffer_sizes(ps) == {"float32": position}


def test_placement_json_round_trip_is_identical():
    placement = place(_variables((64, 64), (9,)), num_ps=2, partitioner=Partitioner(fixed_shards=2))
    assert Placement.from_json(placement.to_json()) == placement


@pytest.mark.parametrize("bad", [{"min_slice_bytes": 0}, {"max_partitions": 0}, {"fixed_shards": 0}])
def test_bad_partitioner_settings_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Partitioner(**bad)


def test_sparse_variables_are_cut_and_balanced_but_kept_out_of_the_buffers():
    variables = _variables((1000, 16), (16, 4), (4,))
    placement = place(variables, num_ps=2, partitioner=Partitioner(fixed_shards=2), sparse={"v0"})
    tables = [p for p in placement.pieces if p.name == "v0"]
    assert [(p.row_start, p.row_end, p.sparse, p.offset) for p in tables] == [(0, 500, True, 0), (500, 1000, True, 0)]
    assert sorted(p.ps for p in tables) == [0, 1]
    assert [placement.tables(ps) for ps in range(2)] == [[p] for p in sorted(tables, key=lambda p: p.ps)]
    # Each PS's buffer holds only its dense pieces.
    dense = sum(p.numel for p in placement.pieces if not p.sparse)
    assert sum(placement.buffer_sizes(ps).get("float32", 0) for ps in range(2)) == dense
    assert Placement.from_json(placement.to_json()) == placement
