"""Checkpoints in model_dir: safetensors plus a JSON manifest, written to a temporary name and renamed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shardflow.ps.checkpointing import ModelState

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
    keep: int | None = None,
) -> Path:
    """Write checkpoint `ckpt-<step>` atomically: a crash leaves either the old latest or the new one, never half.
    With `keep`, only the newest `keep` checkpoints stay."""
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
    if keep is not None:
        # Oldest written first, so a directory that already held higher steps never loses the newest.
        written = sorted((p for p in root.glob("ckpt-*") if p != final), key=lambda p: p.stat().st_mtime)
        for old in written[: max(len(written) - (keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
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


SLOT_SEPARATOR = "::"


def save_state(
    model_dir: str | os.PathLike[str], state: ModelState, manifest: dict[str, Any], keep: int | None = None
) -> Path:
    """A checkpoint of whole variables: parameters under their own names, slots as `slot::<key>::<name>`."""
    tensors = dict(state.params)
    for key, by_name in state.slots.items():
        for name, tensor in by_name.items():
            tensors[SLOT_SEPARATOR.join(("slot", key, name))] = tensor
    return save(
        model_dir, state.step, tensors, {"scalars": state.scalars, "iterators": state.iterators, **manifest}, keep
    )


def load_state(path: str | os.PathLike[str]) -> tuple[ModelState, dict[str, Any]]:
    tensors, manifest = load(path)
    state = ModelState(
        step=int(manifest["global_step"]),
        params={},
        scalars=dict(manifest.get("scalars", {})),
        iterators=dict(manifest.get("iterators", {})),
    )
    for name, tensor in tensors.items():
        if name.startswith("slot" + SLOT_SEPARATOR):
            _, key, variable = name.split(SLOT_SEPARATOR, 2)
            state.slots.setdefault(key, {})[variable] = tensor
        else:
            state.params[name] = tensor
    return state, manifest
