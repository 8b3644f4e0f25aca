"""Specs validate with messages naming the field; checkpoints round-trip and are atomic."""

import json
import os

import numpy as np
import pytest
import torch

import shardflow as sf
from shardflow.data.torch_edge import to_torch
from shardflow.train.checkpoints import store


def test_train_spec_needs_a_length():
    with pytest.raises(ValueError, match="needs max_steps"):
        sf.TrainSpec(lambda ctx: [])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_ps": 0}, "num_ps"),
        ({"num_workers": 0}, "num_workers"),
        ({"mode": "bsp"}, "mode"),
        ({"replicas_to_aggregate": 0}, "replicas_to_aggregate"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"hung_timeout_s": 0}, "hung_timeout_s"),
    ],
)
def test_strategy_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        sf.ParameterServerStrategy(**kwargs)


def test_unknown_optimizer_lists_the_choices():
    with pytest.raises(ValueError, match="Adagrad"):
        sf.optim.OptimizerSpec("Lion")


def test_checkpoint_round_trip_and_latest_pointer(tmp_path):
    tensors = {"w": torch.randn(3, 4), "b": torch.zeros(4)}
    store.save(tmp_path, 7, tensors, {"mode": "sync"})
    path = store.save(tmp_path, 9, {k: v + 1 for k, v in tensors.items()}, {"mode": "sync"})
    assert store.latest(tmp_path) == path
    loaded, manifest = store.load(path)
    assert manifest["global_step"] == 9
    assert torch.equal(loaded["w"], tensors["w"] + 1)
    # Nothing temporary is left behind.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "ckpt-000000007",
        "ckpt-000000009",
        "latest",
    ]


def test_a_half_written_checkpoint_is_never_the_latest(tmp_path):
    good = store.save(tmp_path, 1, {"w": torch.ones(2)}, {})
    # A crash during a save leaves only a temporary directory, which `latest` never points to.
    partial = tmp_path / "checkpoints" / f".tmp-ckpt-000000002-{os.getpid()}"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 10)
    assert store.latest(tmp_path) == good
    assert json.loads((good / "manifest.json").read_text())["global_step"] == 1


def test_estimator_state_dict_loads_into_a_fresh_model(tmp_path):
    model = torch.nn.Linear(3, 2)
    store.save(tmp_path, 5, {k: v.detach() for k, v in model.state_dict().items()}, {})
    est = sf.Estimator(lambda: torch.nn.Linear(3, 2), lambda m, b: m(b).sum(), model_dir=tmp_path)
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(est.state_dict())
    assert torch.equal(fresh.weight, model.weight)
    assert est.global_step == 5


def test_state_dict_without_training_says_so(tmp_path):
    est = sf.Estimator(lambda: torch.nn.Linear(3, 2), lambda m, b: m(b).sum(), model_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="train first"):
        est.state_dict()


def test_numpy_elements_become_tensors_at_the_edge_and_bytes_stay():
    batch = {"x": np.ones((2, 3), np.float32), "id": np.array([b"a", b"b"], dtype=object), "y": (np.int64(3),)}
    out = to_torch(batch)
    assert isinstance(out["x"], torch.Tensor) and out["x"].dtype == torch.float32
    assert isinstance(out["id"], np.ndarray)
    assert isinstance(out["y"][0], torch.Tensor)
