"""HashIndex, the id -> row map of dynamic tables, against a Python dict."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.ps.embeddings.hash_index import HashIndex
from shardflow.ps.embeddings.spec import mix

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# A small pool of ids next to the extremes, so that batches insert, remove and re-insert the same ids often.
ID = st.one_of(st.integers(min_value=-40, max_value=40), st.sampled_from([-(2**63), 2**63 - 1, 2**62]), INT64)
OPERATION = st.tuples(st.sampled_from(["insert", "remove"]), st.lists(ID, max_size=60))


def _ids(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _check(index: HashIndex, expected: dict[int, int], probes: list[int]) -> None:
    assert len(index) == len(expected)
    found = index.find(_ids(probes)).tolist()
    assert found == [expected.get(i, -1) for i in probes]
    ids, slots = index.items()
    assert dict(zip(ids.tolist(), slots.tolist(), strict=True)) == expected


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(OPERATION, max_size=30))
def test_index_agrees_with_a_dict_over_inserts_and_removes(operations):
    index = HashIndex()
    expected: dict[int, int] = {}
    next_slot = 0
    for kind, batch in operations:
        if kind == "insert":
            new = list(dict.fromkeys(i for i in batch if i not in expected))
            index.insert(_ids(new), torch.arange(next_slot, next_slot + len(new)))
            expected.update({i: next_slot + k for k, i in enumerate(new)})
            next_slot += len(new)
        else:
            removed = index.remove(_ids(batch)).tolist()
            assert removed == [expected.get(i, -1) for i in batch]
            for i in batch:
                expected.pop(i, None)
        _check(index, expected, [*batch, 0, -(2**63)])


def test_index_stays_at_most_half_full_as_it_grows():
    index = HashIndex()
    for begin in range(0, 100_000, 7_000):
        index.insert(torch.arange(begin, begin + 7_000), torch.arange(7_000))
        assert len(index) <= index.num_buckets // 2
    assert len(index) == 105_000


def test_removing_and_reinserting_keeps_the_size_bounded():
    index = HashIndex()
    ids = torch.arange(1_000)
    index.insert(ids, ids)
    buckets = index.num_buckets
    for round_ in range(50):
        index.remove(ids)
        index.insert(ids, ids + round_)
    assert index.num_buckets == buckets
    assert torch.equal(index.find(ids), ids + 49)


def test_ids_of_one_ps_of_an_even_count_spread_over_all_buckets():
    ids = torch.arange(200_000)
    ids = ids[mix(ids) % 4 == 0]
    index = HashIndex()
    index.insert(ids, torch.arange(ids.numel()))
    assert torch.equal(index.find(ids), torch.arange(ids.numel()))
    occupied = (index._buckets[:, 1] >= 0).float()  # how the buckets fill is the point
    by_residue = occupied.view(-1, 4).mean(dim=0)  # homes all 0 mod 4 would fill residue 0 first
    assert by_residue.min() > 0.9 * by_residue.max()


def test_memory_is_sixteen_bytes_a_bucket():
    index = HashIndex(1_000)
    assert index.num_buckets == 1_024
    assert index.memory_bytes() == 16 * 1_024
