"""bf16 on the wire (ParameterServerStrategy.wire_dtype="bf16") in a real local cluster: a short sync run stays
within bfloat16's rounding of the float32 run, and the PS keep float32 masters."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

STEPS, BATCH = 20, 8


def _trained(model_dir: Path) -> dict[str, torch.Tensor]:
    root = model_dir / "checkpoints"
    return load_file(str(root / (root / "latest").read_text() / "model.safetensors"))


def _loss(params: dict[str, torch.Tensor]) -> float:
    """The regression job's mean squared error over its whole data set (tests/integration/jobs/regression.py)."""
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(2 * STEPS * BATCH, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(2 * STEPS * BATCH, 1, generator=generator)
    hidden = torch.tanh(x @ params["0.weight"].T + params["0.bias"])
    return torch.nn.functional.mse_loss(hidden @ params["2.weight"].T + params["2.bias"], y).item()


def test_a_sync_run_with_bf16_on_the_wire_stays_within_bf16_rounding_of_the_float32_run(run_job, tmp_path):
    trained = {}
    for wire_dtype in (None, "bf16"):
        model_dir = tmp_path / str(wire_dtype)
        proc, result = run_job(
            "regression.py",
            env={"SHARDFLOW_SHARED_MEMORY": "off"},  # lanes carry float32: the socket is where bf16 applies
            model_dir=str(model_dir),
            wire_dtype=wire_dtype,
            mode="sync",
            num_workers=2,
            num_ps=2,
            epochs=1,
            num_batches=2 * STEPS,
            batch=BATCH,
            hidden=32,
            lr=0.1,
        )
        assert proc.returncode == 0, proc.stdout
        assert result["global_step"] == STEPS
        trained[wire_dtype] = _trained(model_dir)
    exact, narrow = trained[None], trained["bf16"]
    assert all(value.dtype == torch.float32 for value in narrow.values())  # the PS's masters, as checkpointed
    differs = any(not torch.equal(narrow[name], value) for name, value in exact.items())
    assert differs, "the runs are equal: the strategy's wire_dtype did not reach the workers' ParameterClient"
    # bfloat16 keeps 8 significant bits, so each cast is off by at most 2**-9 of the value. Every step computes on
    # parameters so rounded and pushes gradients so rounded, but the float32 masters on the PS keep the rounding
    # from compounding through the parameters: after 20 steps at lr 0.1 they stay within 4 roundings (2**-7) of each
    # tensor's largest value of the float32 run (measured: within one, 2**-9), and so does the loss, relatively.
    for name, value in exact.items():
        torch.testing.assert_close(narrow[name], value, rtol=0, atol=2**-7 * value.abs().max().item())
    assert abs(_loss(narrow) - _loss(exact)) <= 2**-7 * _loss(exact)
