"""Checkpoints in model_dir: safetensors plus a JSON manifest with each file's size and CRC-32C and its own, written
under a temporary name, synced, renamed in, and only then pointed to; a damaged checkpoint is skipped for an older one.

The only module that reads or writes `manifest.json` and `latest` (docs/checkpoints.md describes both)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import google_crc32c
import msgspec
import torch
from safetensors.torch import load_file, save_file

from shardflow import faults

# The PS's table files: staged in model_dir/tables, linked into each checkpoint's own tables/.
from shardflow.ps.embeddings.chains import TABLES, chain_order, link_into, table_chains
from shardflow.ps.embeddings.files import checksum, fsync_dir, save_tensors
from shardflow.ps.embeddings.spec import TableSpec
from shardflow.ps.protocol import TableRestore
from shardflow.train.checkpoints.model_state import ModelState

log = logging.getLogger(__name__)

_DIRECTORY = "checkpoints"
_LATEST = "latest"
_MODEL = "model.safetensors"
_MANIFEST = "manifest.json"
# The manifest's own CRC-32C, of its canonical JSON without this field (see `_manifest_crc32c`).
_MANIFEST_CRC32C = "manifest_crc32c"
# Everything under this prefix is a save or a removal in progress, never a checkpoint; `clean` removes it.
_TEMPORARY = ".tmp-"
# `ckpt-000000100`; a second copy of the same step (a re-save) is `ckpt-000000100.1`.
_NAME = re.compile(r"ckpt-(\d+)(?:\.(\d+))?")
# (path, stat of manifest, stat of model) -> whether it verified; the evaluator asks every 0.5 s.
_verified: dict[tuple[str, tuple[int, ...] | None, tuple[int, ...] | None], bool] = {}
_MAX_VERIFIED = 1024


def directory(model_dir: str | os.PathLike[str]) -> Path:
    """Where model_dir keeps its checkpoints, one directory `ckpt-<step>` each."""
    return Path(model_dir) / _DIRECTORY


def _write_synced(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd`, sync and close it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_record(path: Path, *, sync: bool = False) -> dict[str, Any]:
    """Size and CRC-32C of a file, as the manifest lists it; with `sync`, the file is also fsynced."""
    size, crc32c = checksum(path, sync=sync)
    return {"bytes": size, "crc32c": crc32c}


def _manifest_crc32c(manifest: dict[str, Any]) -> str:
    """CRC-32C of the manifest without its own checksum, as canonical JSON (keys sorted, no spaces) of the values
    as json.loads returns them: the reader computes the same from what it parsed, however the file was indented."""
    body = {key: value for key, value in manifest.items() if key != _MANIFEST_CRC32C}
    canonical = json.dumps(json.loads(json.dumps(body)), sort_keys=True, separators=(",", ":"))
    return f"{google_crc32c.value(canonical.encode()):08x}"


def _step_of(path: Path) -> int | None:
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _checkpoints(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if _step_of(p) is not None]
    except FileNotFoundError:
        return []


def _free_name(root: Path, step: int) -> Path:
    name = f"ckpt-{step:09d}"
    copy = 0
    while (root / name).exists():
        copy += 1
        name = f"ckpt-{step:09d}.{copy}"
    return root / name


def _temporary(root: Path, what: str) -> Path:
    return root / f"{_TEMPORARY}{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _point_latest(root: Path, name: str) -> None:
    """Switch `latest` to `name` atomically, and durably: a synced temporary file renamed over it."""
    tmp = _temporary(root, "latest")
    try:
        _write_synced(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), name.encode())
        os.replace(tmp, root / _LATEST)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: `latest` still names the checkpoint before
        raise
    fsync_dir(root)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_tensors(tensors, path, save=save_file)  # this module's save_file, looked up now (tests replace it)


def _retire(path: Path) -> None:
    """Remove a checkpoint: renamed out of the checkpoint names first, so a crash never leaves half of one."""
    trash = _temporary(path.parent, f"old-{path.name}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def save(
    model_dir: str | os.PathLike[str],
    step: int,
    tensors: dict[str, torch.Tensor],
    manifest: dict[str, Any],
    keep: int | None = None,
    link: Callable[[Path], dict[str, dict[str, Any]]] | None = None,
) -> Path:
    """Write checkpoint `ckpt-<step>` so that at every instant an intact copy of the newest step exists: the new one is
    complete and synced before `latest` points to it. A step saved again is written as `ckpt-<step>.1`, and the older
    copy goes only after `latest` moved to it (an identical one stays instead); then it takes the plain name back.
    With `keep`, only the newest `keep` checkpoints stay. `link(directory)` puts files written elsewhere (the PS's
    table files) into the checkpoint being written, and returns their records for the manifest."""
    root = directory(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(root, f"ckpt-{step:09d}")
    tmp.mkdir()  # not tempfile.mkdtemp: a checkpoint keeps the umask's permissions, not 0700
    try:
        _save_tensors(tensors, tmp / _MODEL)
        files = {_MODEL: _file_record(tmp / _MODEL, sync=True), **(link(tmp) if link is not None else {})}
        full = {"global_step": step, **manifest, "files": files}
        full[_MANIFEST_CRC32C] = _manifest_crc32c(full)
        text = json.dumps(full, indent=1).encode()
        _write_synced(os.open(tmp / _MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), text)
        fsync_dir(tmp)
        faults.reached("checkpoint", "chief", step)
        copies = [p for p in _checkpoints(root) if _step_of(p) == step]
        final = next((p for p in copies if _read_bytes(p / _MANIFEST) == text and _intact(p, step)), None)
        if final is None:
            final = _free_name(root, step)
            os.rename(tmp, final)
            fsync_dir(root)
        else:
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _read_pointer(root) != final.name:
        try:
            _point_latest(root, final.name)
        except OSError:
            if final not in copies:  # written by this save, which failed: no checkpoint of it stays behind
                with contextlib.suppress(OSError):
                    _retire(final)
            raise
    return _tidy(root, final, copies, step, keep)


def _tidy(root: Path, final: Path, copies: list[Path], step: int, keep: int | None) -> Path:
    """Once `latest` points to `final`: retire the older copies of its step, give it the plain name back, and keep
    the newest `keep` checkpoints. Where it ends up. The save is complete already: a failure here (a full or
    read-only disk) is logged and leaves more checkpoints than `keep`, never fewer."""
    try:
        for old in copies:
            if old != final:
                _retire(old)
        plain = root / f"ckpt-{step:09d}"
        if final != plain and not plain.exists():
            # Back to the plain name; until `latest` follows, the scan in `latest()` finds it under that name.
            os.rename(final, plain)
            final = plain
            fsync_dir(root)
            _point_latest(root, final.name)
        if keep is not None:
            # Oldest written first, so a directory that already held higher steps never loses the newest.
            written = sorted((p for p in _checkpoints(root) if p != final), key=lambda p: p.stat().st_mtime)
            for old in written[: max(len(written) - (keep - 1), 0)]:
                _retire(old)
    except OSError as error:
        log.warning("checkpoint %s is saved, but tidying %s failed: %s; older checkpoints may stay", final, root, error)
    return final


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _read_pointer(root: Path) -> str | None:
    data = _read_bytes(root / _LATEST)
    return None if data is None else data.decode(errors="replace").strip()


def _problem(path: Path, step: int) -> str | None:
    """What is wrong with the checkpoint at `path`, or None if it verifies."""
    try:
        manifest = json.loads((path / _MANIFEST).read_bytes())
    except FileNotFoundError:
        return f"{_MANIFEST} is missing"
    except OSError as error:
        return f"cannot read {_MANIFEST}: {error}"
    except ValueError as error:
        return f"{_MANIFEST} is not valid JSON ({error})"
    if not isinstance(manifest, dict):
        return f"{_MANIFEST} is not a JSON object"
    recorded = manifest.get(_MANIFEST_CRC32C)
    if recorded is None:
        log.warning(
            "checkpoint %s was written without %s (by an older shardflow): its input positions and other "
            "fields cannot be verified; it is used as it is",
            path,
            _MANIFEST_CRC32C,
        )
    elif recorded != (crc := _manifest_crc32c(manifest)):
        return f"{_MANIFEST} has CRC-32C {crc}, its {_MANIFEST_CRC32C} says {recorded}"
    if manifest.get("global_step") != step:
        return f"{_MANIFEST} says global step {manifest.get('global_step')!r}, the directory's name {step}"
    files = manifest.get("files", {})  # none in checkpoints written before the manifest listed them
    if not isinstance(files, dict) or not all(isinstance(r, dict) for r in files.values()):
        return f"{_MANIFEST} has a malformed 'files' entry"
    return _files_problem(path, files)


def _files_problem(path: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """What is wrong with the files of the checkpoint at `path` against their records in the manifest, or None."""
    for name in {_MODEL, *files}:
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as error:
            return f"cannot read {name}: {error}"
        if name not in files:
            continue
        record = files[name]
        if size != record.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {record.get('bytes')}"
        try:
            crc = _file_record(file)["crc32c"]
        except OSError as error:
            return f"cannot read {name}: {error}"
        if crc != record.get("crc32c"):
            return f"{name} has CRC-32C {crc}, the manifest says {record.get('crc32c')}"
    return None


def _stat_key(path: Path) -> tuple[int, ...] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _intact(path: Path, step: int) -> bool:
    """Whether the checkpoint verifies; a damaged one is logged once. Files are checksummed only when they changed."""
    key = (str(path), _stat_key(path / _MANIFEST), _stat_key(path / _MODEL))
    if key in _verified:
        return _verified[key]
    problem = _problem(path, step)
    if problem is not None and not path.exists():
        return False  # removed while we looked: an older copy being retired, not damage
    if problem is not None:
        log.warning("skipping damaged checkpoint %s: %s", path, problem)
    if len(_verified) >= _MAX_VERIFIED:
        _verified.clear()
    _verified[key] = problem is None
    return problem is None


def latest(model_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint in model_dir that verifies (of two copies of one step, the one `latest` points to),
    or None. A damaged one is skipped with a warning naming it."""
    root = directory(model_dir)
    pointed = _read_pointer(root)

    def newest_first(path: Path) -> tuple[int, bool, int]:
        try:
            written = path.stat().st_mtime_ns
        except FileNotFoundError:
            written = 0
        return (_step_of(path) or 0, path.name == pointed, written)

    for path in sorted(_checkpoints(root), key=newest_first, reverse=True):
        step = _step_of(path)
        if step is not None and _intact(path, step):
            return path
    return None


def clean(model_dir: str | os.PathLike[str]) -> None:
    """Remove what interrupted saves left (temporary directories and pointer files). Only when no save of this
    job can be running: at the start of the chief."""
    root = directory(model_dir)
    if not root.is_dir():
        return
    leftovers = [p for p in root.iterdir() if p.name.startswith(_TEMPORARY) or p.name == f".{_LATEST}.tmp"]
    for path in leftovers:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if leftovers:
        log.info("removed %d leftovers of interrupted checkpoint saves from %s", len(leftovers), root)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a checkpoint, without loading its tensors."""
    manifest: dict[str, Any] = json.loads((Path(path) / _MANIFEST).read_bytes())
    return manifest


def global_step(path: str | os.PathLike[str]) -> int:
    """The global step a checkpoint holds, without loading its tensors."""
    return int(read_manifest(path)["global_step"])


def latest_step(model_dir: str | os.PathLike[str]) -> int:
    """The global step of the newest intact checkpoint in model_dir; 0 where there is none."""
    path = latest(model_dir)
    return 0 if path is None else global_step(path)


def named(model_dir: str | os.PathLike[str], name: str) -> Path | None:
    """The checkpoint `name` (e.g. `ckpt-000000100`) in model_dir, or None where there is no such checkpoint."""
    path = directory(model_dir) / name
    return path if (path / _MANIFEST).exists() else None


def load(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    return load_file(str(path / _MODEL)), read_manifest(path)


SLOT_SEPARATOR = "::"


def save_state(
    model_dir: str | os.PathLike[str],
    state: ModelState,
    manifest: dict[str, Any],
    keep: int | None = None,
    table_specs: Sequence[TableSpec] = (),
) -> Path:
    """A checkpoint of whole variables: parameters under their own names, slots as `slot::<key>::<name>`."""
    tensors = dict(state.params)
    for key, by_name in state.slots.items():
        for name, tensor in by_name.items():
            tensors[SLOT_SEPARATOR.join(("slot", key, name))] = tensor
    extra = {"scalars": state.scalars, "iterators": state.iterators, "ps_progress": state.ps_progress}
    if state.table_errors:  # as a failed write of the checkpoint itself (see CheckpointManager.save)
        raise OSError(errno.EIO, "; ".join(state.table_errors))
    link = None
    if state.table_files:
        ordered = chain_order(state.table_files)
        specs = {spec.name: spec for spec in table_specs}
        chains: dict[str, list[str]] = {}
        for record in ordered:
            chains.setdefault(record.table, []).append(f"{TABLES}/{record.path}")
        extra["tables"] = {
            name: {"spec": msgspec.to_builtins(specs[name]) if name in specs else None, "chain": chain}
            for name, chain in chains.items()
        }

        def link(directory: Path) -> dict[str, dict[str, Any]]:
            return link_into(directory, table_staging(model_dir), ordered)

    return save(model_dir, state.step, tensors, {**extra, **manifest}, keep, link)


def table_staging(model_dir: str | os.PathLike[str]) -> Path:
    """Where the PS write the files of their `sf.nn` tables' rows, linked into each checkpoint from there."""
    return Path(model_dir) / TABLES


def load_state(path: str | os.PathLike[str]) -> tuple[ModelState, dict[str, Any]]:
    tensors, manifest = load(path)
    chains = table_chains(manifest)
    state = ModelState(
        step=int(manifest["global_step"]),
        params={},
        scalars=dict(manifest.get("scalars", {})),
        iterators=dict(manifest.get("iterators", {})),
        ps_progress=list(manifest.get("ps_progress", [])),
        tables=TableRestore(
            checkpoint=str(Path(path).resolve()), chains={name: tuple(chain) for name, (_, chain) in chains.items()}
        )
        if chains
        else None,
    )
    for name, tensor in tensors.items():
        if name.startswith("slot" + SLOT_SEPARATOR):
            _, key, variable = name.split(SLOT_SEPARATOR, 2)
            state.slots.setdefault(key, {})[variable] = tensor
        else:
            state.params[name] = tensor
    return state, manifest
