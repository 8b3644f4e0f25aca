"""shardflow export writes a plain state_dict that torch loads."""

import torch
from safetensors.torch import load_file

from shardflow.cli.main import main
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
