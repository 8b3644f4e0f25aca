"""shardflow export writes a plain state_dict that torch loads, and the rows of sf.nn tables with their ids."""

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from shardflow.cli.main import main
from shardflow.ps.embeddings.chains import link_into
from shardflow.ps.embeddings.files import write_shard
from shardflow.ps.embeddings.spec import TableSpec
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.model_state import ModelState


def test_export_writes_the_parameters_without_optimizer_slots(tmp_path, capsys):
    model = torch.nn.Linear(3, 2)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = ModelState(step=7, params=params, slots={"exp_avg": {k: torch.zeros_like(v) for k, v in params.items()}})
    store.save_state(tmp_path / "model", state, {})
    assert main(["export", str(tmp_path / "model"), str(tmp_path / "out.safetensors")]) == 0
    exported = load_file(str(tmp_path / "out.safetensors"))
    assert set(exported) == {"weight", "bias"}
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(exported)
    assert torch.equal(fresh.weight, model.weight)
    assert "global step 7" in capsys.readouterr().out


def test_export_without_a_checkpoint_says_train_first(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "out.safetensors")]) == 2
    assert "train first" in capsys.readouterr().err


def _table_checkpoint(model_dir, num_ps=2):
    """A checkpoint holding table "towers.0.users" (ids 0..9, dim 2), a full file from each of `num_ps` PS,
    staged in model_dir/tables and linked in."""
    spec = TableSpec(name="towers.0.users", embedding_dim=2, num_embeddings=10)
    ids = torch.arange(10)
    records = [
        write_shard(
            model_dir / "tables", spec, step=5, ps_index=k, num_ps=num_ps, kind="full", scalars={},
            state={"ids": ids[ids % num_ps == k], "values": ids[ids % num_ps == k, None].float().expand(-1, 2)},
        )
        for k in range(num_ps)
    ]  # fmt: skip
    tables = {spec.name: {"spec": msgspec.to_builtins(spec), "chain": [f"tables/{r.path}" for r in records]}}
    checkpoint = store.save(model_dir, 5, {"dense": torch.ones(3)}, {"tables": tables})
    link_into(checkpoint, model_dir / "tables", records)
    return checkpoint


def test_export_embeddings_writes_each_table_and_prints_its_rows(tmp_path, capsys):
    _table_checkpoint(tmp_path / "model")
    assert main(["export", str(tmp_path / "model"), "--embeddings", str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "towers.0.users.safetensors"))
    assert torch.equal(exported["ids"], torch.arange(10))
    assert torch.equal(exported["values"], torch.arange(10.0)[:, None].expand(-1, 2))
    out = capsys.readouterr().out
    assert "towers.0.users" in out and " 10 " in out and "index.json" in out


def test_export_writes_parameters_and_tables_together(tmp_path):
    _table_checkpoint(tmp_path / "model")
    args = ["export", str(tmp_path / "model"), str(tmp_path / "p.safetensors"), "--embeddings", str(tmp_path / "e")]
    assert main(args) == 0
    assert set(load_file(str(tmp_path / "p.safetensors"))) == {"dense"}
    assert (tmp_path / "e" / "index.json").exists()


def test_export_of_an_unknown_table_names_the_tables_there_are(tmp_path, capsys):
    _table_checkpoint(tmp_path / "model")
    args = ["export", str(tmp_path / "model"), "--embeddings", str(tmp_path / "out"), "--tables", "items"]
    assert main(args) == 2
    assert "has no table items; its tables: towers.0.users" in capsys.readouterr().err


def test_export_embeddings_of_a_checkpoint_without_tables_says_so(tmp_path, capsys):
    store.save(tmp_path / "model", 3, {"dense": torch.ones(1)}, {})
    assert main(["export", str(tmp_path / "model"), "--embeddings", str(tmp_path / "out")]) == 2
    assert "holds no sf.nn tables" in capsys.readouterr().err


def test_export_with_nothing_to_write_says_what_to_name(tmp_path, capsys):
    _table_checkpoint(tmp_path / "model")
    assert main(["export", str(tmp_path / "model")]) == 2
    assert "name OUT.safetensors, --embeddings DIR or both" in capsys.readouterr().err


def test_export_tables_without_embeddings_is_refused(tmp_path, capsys):
    _table_checkpoint(tmp_path / "model")
    assert main(["export", str(tmp_path / "model"), str(tmp_path / "p.safetensors"), "--tables", "a"]) == 2
    assert "add --embeddings DIR" in capsys.readouterr().err


def test_export_of_an_unknown_checkpoint_names_it(tmp_path, capsys):
    _table_checkpoint(tmp_path / "model")
    args = ["export", str(tmp_path / "model"), "--embeddings", str(tmp_path / "o"), "--checkpoint", "ckpt-9"]
    assert main(args) == 2
    assert "no checkpoint 'ckpt-9'" in capsys.readouterr().err


def test_export_help_explains_embeddings_and_tables(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    assert "--embeddings DIR" in out and "--tables A,B" in out and "index.json" in out
