"""The files that carry a table's rows: written atomically, verified on read, ordered into chains, replayed onto any
number of PS, linked into checkpoints and pruned."""

import os
import subprocess

import pytest
import torch
from synthetic_tables import DYNAMIC, FIXED, DictTable, scenario_rows, state_of, write_scenario

from shardflow.ps.embeddings.chains import (
    chain_order,
    link_into,
    prune_staged,
    remove_temporaries,
    replay,
    table_chains,
)
from shardflow.ps.embeddings.files import FileRecord, read_shard, write_shard
from shardflow.train.checkpoints import store


def _write(directory, spec=FIXED, *, step=10, ps_index=0, num_ps=2, kind="full", state=None, scalars=None):
    state = state_of(spec, [0, 3, 7], step) if state is None else state
    return write_shard(
        directory, spec, step=step, ps_index=ps_index, num_ps=num_ps, kind=kind, state=state, scalars=scalars or {}
    )


def _record(step, kind, ps_index, num_ps=2, table="items"):
    name = f"step-{step:09d}-ps-{ps_index:05d}-of-{num_ps:05d}-{kind}.safetensors"
    return FileRecord(
        path=f"{table}/{name}", bytes=1, crc32c="0", table=table, step=step, kind=kind, ps_index=ps_index, num_ps=num_ps
    )


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted at tmp_path/tmpfs: a disk that fills, and another filesystem."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a small tmpfs needs root with CAP_SYS_ADMIN")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_written_file_reads_back_its_state_spec_step_and_scalars(tmp_path):
    state = state_of(FIXED, [0, 3, 7], 10)
    record = _write(tmp_path, state=state, scalars={"step": 4.0})
    spec, meta, read = read_shard(tmp_path / record.path, record)
    assert spec == FIXED
    assert (meta.table, meta.step, meta.kind, meta.ps_index, meta.num_ps) == ("items", 10, "full", 0, 2)
    assert meta.scalars == {"step": 4.0}
    assert read.keys() == state.keys()
    assert all(torch.equal(read[key], state[key]) for key in state)


def test_file_is_named_by_table_step_and_ps_and_its_record_by_its_bytes(tmp_path):
    record = _write(tmp_path, DYNAMIC, step=20, ps_index=1, num_ps=3, kind="increment")
    assert record.path == "towers.0.users/step-000000020-ps-00001-of-00003-increment.safetensors"
    assert {"bytes": record.bytes, "crc32c": record.crc32c} == store._file_record(tmp_path / record.path)


@pytest.mark.parametrize("name", ["a/b", "..", "x..y", ".hidden", "", "a\\b"])
def test_a_table_name_that_could_leave_its_directory_is_refused(tmp_path, name):
    spec = FIXED.__class__(name=name, embedding_dim=4, num_embeddings=1000)
    with pytest.raises(ValueError, match="table name"):
        _write(tmp_path, spec, state=state_of(spec, [1], 10))


def test_a_state_of_another_dimension_is_refused_naming_the_table(tmp_path):
    with pytest.raises(ValueError, match=r"table 'items', ps 0, step 10: 'values' is .* not float32 \[3, 4\]"):
        _write(tmp_path, state=state_of(DYNAMIC, [0, 3, 7], 10))


def test_a_full_file_with_removed_ids_is_refused(tmp_path):
    with pytest.raises(ValueError, match="only an increment removes rows"):
        _write(tmp_path, state={**state_of(FIXED, [1], 10), "removed": torch.tensor([2])})


def test_a_changed_byte_is_named_as_a_crc_mismatch_of_the_file(tmp_path):
    record = _write(tmp_path)
    path = tmp_path / record.path
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{path}: CRC-32C [0-9a-f]{{8}}, its record says {record.crc32c}"):
        read_shard(path, record)


def test_a_truncated_file_is_named_with_its_size(tmp_path):
    record = _write(tmp_path)
    path = tmp_path / record.path
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=rf"{path}: {record.bytes - 8} bytes, its record says {record.bytes}"):
        read_shard(path, record)


def test_a_damaged_header_length_is_named_with_its_offset(tmp_path):
    path = tmp_path / _write(tmp_path).path
    path.write_bytes((1 << 40).to_bytes(8, "little") + path.read_bytes()[8:])
    with pytest.raises(ValueError, match=rf"{path}: the header length at offset 0"):
        read_shard(path)


def test_a_tensor_running_past_the_data_is_named_with_its_offsets(tmp_path):
    path = tmp_path / _write(tmp_path).path
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match=rf"{path}: tensor '\w+' .* at data offsets \[\d+, \d+\) does not fit"):
        read_shard(path)


def test_a_file_holding_another_step_than_its_record_is_refused(tmp_path):
    record = _write(tmp_path, step=10)
    moved = FileRecord(**{**{f: getattr(record, f) for f in record.__struct_fields__}, "step": 20})
    with pytest.raises(ValueError, match=r"holds \(table, step, kind, ps, num_ps\) \('items', 10,"):
        read_shard(tmp_path / record.path, moved)


def test_a_full_disk_raises_oserror_and_leaves_no_file(tmpfs):
    big = state_of(DYNAMIC, list(range(5000)), 10)  # 160 KB into 64 KiB
    with pytest.raises(OSError, match="No space left"):
        _write(tmpfs, DYNAMIC, state=big)
    assert list((tmpfs / DYNAMIC.name).iterdir()) == []


def test_chain_is_the_latest_fulls_then_the_increments_after_them_in_step_order():
    old = [_record(10, "full", 0), _record(10, "full", 1), _record(20, "increment", 1), _record(20, "increment", 0)]
    chain = [_record(30, "full", 1), _record(30, "full", 0), _record(50, "increment", 0), _record(40, "increment", 1)]
    chain += [_record(40, "increment", 0), _record(50, "increment", 1)]
    ordered = chain_order(old + chain + [_record(40, "increment", 0)])  # a record reported twice is one file
    assert [(r.kind, r.step, r.ps_index) for r in ordered] == [
        ("full", 30, 0), ("full", 30, 1), ("increment", 40, 0), ("increment", 40, 1),
        ("increment", 50, 0), ("increment", 50, 1),
    ]  # fmt: skip


def test_a_ps_a_full_file_ahead_of_the_other_keeps_its_own_chain():
    # ps:0 took a snapshot ps:1 never heard of (its chief died as it asked), so ps:0 wrote a full file at 30 where
    # ps:1 wrote an increment: each PS's rows replay from its own chain.
    records = [_record(10, "full", 0), _record(10, "full", 1), _record(20, "increment", 1), _record(30, "full", 0)]
    records += [_record(30, "increment", 1), _record(40, "increment", 1), _record(40, "increment", 0)]
    assert [(r.kind, r.step, r.ps_index) for r in chain_order(records)] == [
        ("full", 10, 1), ("increment", 20, 1), ("full", 30, 0), ("increment", 30, 1),
        ("increment", 40, 0), ("increment", 40, 1),
    ]  # fmt: skip


def test_a_ps_whose_chain_stops_short_of_the_latest_full_step_is_named():
    records = [_record(10, "full", 0), _record(10, "full", 1), _record(20, "increment", 1), _record(30, "full", 0)]
    with pytest.raises(ValueError, match=r"table 'items': the files of step 30 lack ps \[1\] of 2"):
        chain_order(records)


def test_chains_whose_full_files_are_of_each_ps_own_step_end_together():
    # A restarted chief read each PS's state at its own step (155 and 156): each wrote a full file there.
    records = [_record(155, "full", 0), _record(156, "full", 1), _record(159, "increment", 0)]
    records.append(_record(159, "increment", 1))
    assert [(r.kind, r.step, r.ps_index) for r in chain_order(records)] == [
        ("full", 155, 0), ("full", 156, 1), ("increment", 159, 0), ("increment", 159, 1),
    ]  # fmt: skip


def test_an_increment_of_another_number_of_ps_behind_the_latest_full_step_is_refused():
    records = [_record(10, "full", 0), _record(10, "full", 1), _record(20, "increment", 1, 3), _record(30, "full", 0)]
    with pytest.raises(ValueError, match=r"step 20 were written by jobs of \[3\] PS, the chain's full files by 2"):
        chain_order([*records, _record(30, "increment", 1)])


def test_chains_of_two_tables_come_table_by_table():
    records = [_record(10, "full", 0, 1, table="b"), _record(10, "full", 0, 1, table="a")]
    assert [r.table for r in chain_order(records)] == ["a", "b"]


def test_chain_lacking_a_full_file_names_the_ps():
    with pytest.raises(ValueError, match=r"table 'items': the full files of step 30 lack ps \[1\] of 3"):
        chain_order([_record(30, "full", 0, 3), _record(30, "full", 2, 3)])


def test_chain_lacking_an_increment_names_the_step_and_ps():
    records = [_record(10, "full", 0), _record(10, "full", 1), _record(20, "increment", 1)]
    with pytest.raises(ValueError, match=r"the increment files of step 20 lack ps \[0\] of 2"):
        chain_order(records)


def test_chain_without_a_full_file_is_refused():
    with pytest.raises(ValueError, match="no full file"):
        chain_order([_record(20, "increment", 0, 1)])


def test_increments_written_by_another_number_of_ps_are_refused():
    records = [_record(10, "full", 0, 1), *(_record(20, "increment", k, 2) for k in range(2))]
    with pytest.raises(ValueError, match=r"step 20 were written by jobs of \[2\] PS, the chain's full files by 1"):
        chain_order(records)


def test_two_different_files_of_one_step_and_ps_are_refused():
    second = FileRecord(**{**{f: getattr(_record(10, "full", 0), f) for f in FileRecord.__struct_fields__}, "bytes": 2})
    with pytest.raises(ValueError, match="two different full files of step 10, ps 0"):
        chain_order([_record(10, "full", 0), second])


def _replay_onto(directory, chain, num_ps):
    tables = [DictTable(DYNAMIC, k, num_ps) for k in range(num_ps)]
    for table in tables:
        replay([(directory / r.path, r) for r in chain], DYNAMIC, table.load_rows)
    return tables


def test_two_ps_chain_replayed_onto_three_ps_holds_the_rows_of_one(tmp_path):
    chain = chain_order(write_scenario(tmp_path, DYNAMIC, num_ps=2))
    three = _replay_onto(tmp_path, chain, 3)
    (one,) = _replay_onto(tmp_path, chain, 1)
    merged = {id_: row for table in three for id_, row in table.rows.items()}
    assert sum(len(table.rows) for table in three) == len(merged)
    assert merged.keys() == one.rows.keys() == scenario_rows(DYNAMIC).keys()
    assert all(torch.equal(merged[id_], one.rows[id_]) for id_ in merged)


def test_replay_honours_removed_ids_and_readmissions(tmp_path):
    chain = chain_order(write_scenario(tmp_path, DYNAMIC, num_ps=2))
    (one,) = _replay_onto(tmp_path, chain, 1)
    assert sorted(one.rows) == [5, 17, 42, 77, 500, 640]  # 8 and 99 removed, 999 removed, 42 removed and back
    assert torch.equal(one.rows[42], scenario_rows(DYNAMIC)[42])


def test_replay_refuses_files_out_of_chain_order_before_feeding_any(tmp_path):
    chain = chain_order(write_scenario(tmp_path, DYNAMIC, num_ps=2))
    fed: list[dict[str, torch.Tensor]] = []
    swapped = [chain[0], chain[1], chain[4], chain[5], chain[2], chain[3]]
    with pytest.raises(ValueError, match="not a chain in order"):
        replay([(tmp_path / r.path, r) for r in swapped], DYNAMIC, fed.append)
    assert fed == []


def test_replay_refuses_a_chain_lacking_a_ps_increment(tmp_path):
    chain = chain_order(write_scenario(tmp_path, DYNAMIC, num_ps=2))
    with pytest.raises(ValueError, match=r"increment files of step 20 lack ps \[1\]"):
        replay([(tmp_path / r.path, r) for r in chain if r.path != chain[3].path], DYNAMIC, lambda state: None)


def test_linked_files_have_the_manifest_entries_store_computes(tmp_path):
    staged = tmp_path / "tables"
    chain = chain_order(write_scenario(staged, DYNAMIC, num_ps=2))
    entries = link_into(tmp_path / "ckpt", staged, chain)
    assert entries == {f"tables/{r.path}": store._file_record(tmp_path / "ckpt" / "tables" / r.path) for r in chain}
    assert all(os.path.samefile(staged / r.path, tmp_path / "ckpt" / "tables" / r.path) for r in chain)


def test_files_on_another_filesystem_are_copied_into_the_checkpoint(tmp_path, tmpfs):
    staged = tmp_path / "tables"
    record = _write(staged, state=state_of(FIXED, [1, 2], 10))
    entries = link_into(tmpfs / "ckpt", staged, [record])
    assert entries == {f"tables/{record.path}": store._file_record(tmpfs / "ckpt" / "tables" / record.path)}


def test_pruning_keeps_the_kept_files_and_those_of_later_steps(tmp_path):
    records = write_scenario(tmp_path, DYNAMIC, num_ps=1)  # steps 10, 20, 30
    keep = {records[1].path}
    assert prune_staged(tmp_path, keep, through_step=20) == [records[0].path]
    assert sorted(p.name for p in (tmp_path / DYNAMIC.name).iterdir()) == sorted(
        r.path.split("/")[1] for r in records[1:]
    )


def test_a_ps_removes_only_its_own_interrupted_writes(tmp_path):
    (tmp_path / "items").mkdir()
    mine = tmp_path / "items" / ".tmp-step-000000010-ps-00001-of-00002-full.safetensors-0a1b2c3d"
    other = tmp_path / "items" / ".tmp-step-000000010-ps-00000-of-00002-full.safetensors-0a1b2c3d"
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    assert remove_temporaries(tmp_path, 1) == 1
    assert not mine.exists() and other.exists()


def test_table_chains_refuse_a_chain_file_outside_its_table():
    entry = {"spec": {"name": "items", "embedding_dim": 4}, "chain": ["tables/users/" + _record(1, "full", 0).path[6:]]}
    with pytest.raises(ValueError, match="chain of table 'items' names 'tables/users/step-"):
        table_chains({"tables": {"items": entry}})


def test_table_chains_name_a_malformed_entry():
    with pytest.raises(ValueError, match="entry of table 'items' is malformed"):
        table_chains({"tables": {"items": {"spec": {"name": "items"}, "chain": []}}})
