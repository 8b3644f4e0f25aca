"""A checkpoint's tables gathered from every PS's chain: exported for serving, looked up by the evaluator."""

import json

import pytest
import torch
from safetensors.torch import load_file
from synthetic_tables import DYNAMIC, FIXED, save_checkpoint, scenario_rows, state_of

from shardflow.ps.embeddings.chains import chain_files, table_chains
from shardflow.ps.embeddings.files import write_shard
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.table_rows import CheckpointRows, export_tables, gather_rows


def _expected(spec):
    rows = scenario_rows(spec)
    ids = sorted(rows)
    return torch.tensor(ids, dtype=torch.int64), torch.stack([rows[i] for i in ids])


def test_export_writes_each_table_as_sorted_ids_and_their_values(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [DYNAMIC, FIXED])
    export_tables(checkpoint, tmp_path / "out")
    for spec in (DYNAMIC, FIXED):
        exported = load_file(str(tmp_path / "out" / f"{spec.name}.safetensors"))
        ids, values = _expected(spec)
        assert torch.equal(exported["ids"], ids)
        assert torch.equal(exported["values"], values)


def test_export_index_describes_each_table(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [DYNAMIC])
    export_tables(checkpoint, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    table = index["tables"][DYNAMIC.name]
    assert (index["checkpoint"], index["global_step"]) == (checkpoint.name, 30)
    assert (table["dim"], table["rows"], table["dtype"], table["spec"]["name"]) == (3, 6, "float32", DYNAMIC.name)
    assert [f["path"] for f in table["files"]] == [f"{DYNAMIC.name}.safetensors"]
    assert table["files"][0] == {
        "path": f"{DYNAMIC.name}.safetensors",
        "rows": 6,
        **store._file_record(tmp_path / "out" / f"{DYNAMIC.name}.safetensors"),
        "first_id": 5,
        "last_id": 640,
    }


def test_a_table_over_the_size_limit_is_cut_into_files_by_ranges_of_ids(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [FIXED])
    (table,) = export_tables(checkpoint, tmp_path / "out", max_file_bytes=2 * (4 * 4 + 8))  # two rows a file
    assert [f.path for f in table.files] == [f"items-{k:05d}-of-00003.safetensors" for k in range(3)]
    parts = [load_file(str(tmp_path / "out" / f.path)) for f in table.files]
    ids, values = _expected(FIXED)
    assert torch.equal(torch.cat([p["ids"] for p in parts]), ids)
    assert torch.equal(torch.cat([p["values"] for p in parts]), values)


def test_an_export_cut_differently_replaces_the_files_of_the_one_before(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [FIXED])
    export_tables(checkpoint, tmp_path / "out", max_file_bytes=2 * (4 * 4 + 8))
    export_tables(checkpoint, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.json", "items.safetensors"]


def test_export_of_chosen_tables_writes_only_those(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [DYNAMIC, FIXED])
    export_tables(checkpoint, tmp_path / "out", ["items"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.json", "items.safetensors"]


def test_export_of_an_unknown_table_names_the_tables_there_are(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [FIXED])
    with pytest.raises(ValueError, match="has no table users; its tables: items"):
        export_tables(checkpoint, tmp_path / "out", ["users"])


def test_export_of_a_checkpoint_without_tables_says_so(tmp_path):
    checkpoint = store.save(tmp_path / "model", 1, {"dense": torch.ones(1)}, {})
    with pytest.raises(ValueError, match=r"holds no sf\.nn tables"):
        export_tables(checkpoint, tmp_path / "out")


def test_export_names_a_damaged_table_file(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [FIXED])
    damaged = next((checkpoint / "tables" / "items").iterdir())
    damaged.write_bytes(damaged.read_bytes()[:-4])
    with pytest.raises(ValueError, match=str(damaged)):
        export_tables(checkpoint, tmp_path / "out")


def test_checkpoint_rows_read_the_checkpoint_and_the_default_for_absent_ids(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [DYNAMIC])
    rows = CheckpointRows(checkpoint, DYNAMIC.name, default=lambda ids: torch.full((ids.numel(), 3), -1.0))
    found = rows.lookup(torch.tensor([[640, 8], [5, 12345]]))
    expected = scenario_rows(DYNAMIC)
    assert found.shape == (2, 2, 3)
    assert torch.equal(found[0, 0], expected[640]) and torch.equal(found[1, 0], expected[5])
    assert torch.equal(found[0, 1], torch.full((3,), -1.0)) and torch.equal(found[1, 1], torch.full((3,), -1.0))


def test_an_id_in_the_full_files_of_two_ps_is_named(tmp_path):
    staged = tmp_path / "tables"
    records = [
        write_shard(staged, FIXED, step=1, ps_index=k, num_ps=2, kind="full", state=state_of(FIXED, ids, 1), scalars={})
        for k, ids in enumerate([[1, 2], [2, 3]])
    ]
    with pytest.raises(ValueError, match=r"id 2 is in two full files, .*ps-00000.* and .*ps-00001"):
        gather_rows([(staged / r.path, r) for r in records], FIXED)


def test_a_table_file_unlike_its_manifest_entry_is_named(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "model", [FIXED])
    spec, chain = table_chains(store.read_manifest(checkpoint))["items"]
    files = {path: store._file_record(checkpoint / path) for path in chain}
    files[chain[1]] = {**files[chain[1]], "crc32c": "00000000"}
    with pytest.raises(ValueError, match=rf"{checkpoint / chain[1]}: CRC-32C [0-9a-f]{{8}}, its record says 00000000"):
        gather_rows(chain_files(checkpoint, {"files": files}, chain), spec)
