"""Checkpoints in model_dir: safetensors plus a JSON manifest, written to a temporary name and renamed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    model_dir: str | os.PathLike[str],
    step: int,
    tensors: dict[str, torch.Tensor],
    manifest: dict[str, Any],
) -> Path:
    """Write checkpoint `ckpt-<step>` atomically: a crash leaves either the old latest or the new one, never half."""
    root = Path(model_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{step:09d}"
    tmp = root / f".tmp-ckpt-{step:09d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    with open(tmp / "manifest.json", "w") as f:
        json.dump({"global_step": step, **manifest}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f".{_LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / _LATEST)
    _fsync_dir(root)
    return final


def latest(model_dir: str | os.PathLike[str]) -> Path | None:
    pointer = Path(model_dir) / "checkpoints" / _LATEST
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def load(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    with open(path / "manifest.json") as f:
        manifest = json.load(f)
    return load_file(str(path / "model.safetensors")), manifest
