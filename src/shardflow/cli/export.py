"""Write a checkpoint's parameters as a plain safetensors state_dict, and its sf.nn tables' rows for serving."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "examples:\n"
        "  shardflow export runs/clicks model.safetensors\n"
        "      then, in PyTorch: model.load_state_dict(safetensors.torch.load_file('model.safetensors'))\n"
        "  shardflow export runs/clicks --embeddings tables/ --tables items,users\n"
        "      writes tables/items.safetensors ('ids': int64 sorted, 'values': [rows, dim]) and tables/index.json;\n"
        "      a table over 2 GiB is cut into items-00000-of-00003.safetensors, ... by ranges of ids"
    )
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="the Estimator's model_dir")
    parser.add_argument(
        "output",
        type=Path,
        nargs="?",
        metavar="OUT.safetensors",
        help="file to write the parameters to (not the sf.nn tables, which live on the PS)",
    )
    parser.add_argument(
        "--embeddings",
        type=Path,
        metavar="DIR",
        help="directory to write each sf.nn table's rows to, with their ids, and an index.json describing them",
    )
    parser.add_argument(
        "--tables",
        metavar="A,B",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        help="with --embeddings: only these tables, by their module paths (all of them when left out)",
    )
    parser.add_argument("--checkpoint", metavar="NAME", help="a checkpoint under MODEL_DIR/checkpoints (the latest)")


def _fail(message: str, code: int = 2) -> int:
    print(f"shardflow export: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from shardflow.train.checkpoints import store

    if args.output is None and args.embeddings is None:
        return _fail("name OUT.safetensors, --embeddings DIR or both: nothing to write")
    if args.tables is not None and args.embeddings is None:
        return _fail("--tables chooses the tables --embeddings writes; add --embeddings DIR")
    if args.tables == []:
        return _fail("--tables names no table; leave it out to write them all")
    where = store.directory(args.model_dir)
    if args.checkpoint:
        path = store.named(args.model_dir, args.checkpoint)
        if path is None:
            return _fail(f"no checkpoint {args.checkpoint!r} in {where}")
    else:
        path = store.latest(args.model_dir)
        if path is None:
            return _fail(f"no checkpoint in {where}; train first")
    if args.embeddings is not None:
        code = _export_tables(path, args.embeddings, args.tables)
        if code:
            return code
    if args.output is not None:
        _export_parameters(path, args.output)
    return 0


def _export_tables(checkpoint: Path, out_dir: Path, tables: list[str] | None) -> int:
    from shardflow.cli.tables import print_table
    from shardflow.train.checkpoints.table_rows import INDEX, export_tables

    try:
        exported = export_tables(checkpoint, out_dir, tables)
    except ValueError as error:  # no tables, an unknown one, a damaged file
        return _fail(str(error))
    except OSError as error:  # a file missing or unreadable, a full disk
        return _fail(str(error), code=1)
    rows = [
        (t.table, t.rows, t.dim, sum(f.bytes for f in t.files), ", ".join(f.path for f in t.files)) for t in exported
    ]
    print_table(None, ["table", "rows", "dim", "bytes", "files"], rows, right={"rows", "dim", "bytes"})
    print(f"wrote {len(exported)} tables from {checkpoint.name} to {out_dir}, described in {out_dir / INDEX}")
    return 0


def _export_parameters(checkpoint: Path, output: Path) -> None:
    from safetensors.torch import save_file

    from shardflow.train.checkpoints import store

    state, _ = store.load_state(checkpoint)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.contiguous() for name, tensor in state.params.items()},
        str(output),
        metadata={"global_step": str(state.step)},
    )
    print(f"wrote {len(state.params)} tensors from {checkpoint.name} (global step {state.step}) to {output}")
