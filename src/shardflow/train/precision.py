"""Mixed precision on the workers: the forward runs under `torch.autocast`; the parameters (the PS's master
weights), their gradients and the pushes stay float32."""

from __future__ import annotations

import contextlib

import torch

MIXED_PRECISIONS = ("bf16",)


def check_mixed_precision(mixed_precision: str | None, strategy: str = "ParameterServerStrategy") -> None:
    """Raise ValueError, naming the option of `strategy`, for a mixed precision the workers cannot run."""
    if mixed_precision is None or mixed_precision in MIXED_PRECISIONS:
        return
    if mixed_precision == "fp16":
        raise ValueError(
            f"{strategy}.mixed_precision='fp16' needs a GradScaler, which shardflow workers do not run: "
            "use mixed_precision='bf16', which needs no loss scaling"
        )
    raise ValueError(f"{strategy}.mixed_precision must be None or one of {MIXED_PRECISIONS}")


def autocast(mixed_precision: str | None, device_type: str = "cpu") -> contextlib.AbstractContextManager[object]:
    """The context the forward (the loss function) runs in: autocast to bfloat16 on the worker's device type
    ("cpu", "cuda"), or nothing."""
    if mixed_precision is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)
