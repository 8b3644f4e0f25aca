"""Inspect record files: count records, verify every CRC, and infer the tf.train.Example schema."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardflow.cli.tables import print_table

if TYPE_CHECKING:
    from shardflow.data.example.schema import ExampleSchema

EPILOG = """\
examples:
  shardflow data inspect train-*.tfrecord
  shardflow data inspect --compression-type ZLIB part-0.tfrecord.z

Every record's length and data CRCs are checked. A corrupt or truncated file is reported with the byte offset
of its first bad record, and the exit status is then 1. GZIP files are recognized by their first bytes.
"""

_GZIP_MAGIC = b"\x1f\x8b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    commands = parser.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    inspect = commands.add_parser("inspect", help="record counts, CRC checks and the Example schema of TFRecord files")
    inspect.add_argument("files", nargs="+", metavar="FILE", help="TFRecord files")
    inspect.add_argument(
        "--compression-type",
        choices=["auto", "none", "GZIP", "ZLIB"],
        default="auto",
        help="how the files are compressed (auto: GZIP if a file starts like one, else none)",
    )


@dataclass
class FileReport:
    filename: str
    num_records: int
    compression_type: str
    error: str | None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from shardflow.data.example.schema import ExampleSchema

    console = Console()
    schema = ExampleSchema()
    reports = [_inspect_file(filename, args.compression_type, schema) for filename in args.files]
    _print_files(reports)
    if schema.features:
        print()
        _print_schema(schema)
    elif schema.num_records:
        console.print("The records are not tf.train.Examples: no schema to show.")
    failed = [report for report in reports if report.error is not None]
    for report in failed:
        console.print(f"[bold red]error:[/] {escape(report.error or '')}", highlight=False, soft_wrap=True)
    return 1 if failed else 0


def _inspect_file(filename: str, compression_type: str, schema: ExampleSchema) -> FileReport:
    from shardflow.data.sources import DataLossError, TFRecordDataset

    num_records = 0
    batch: list[bytes] = []
    try:
        if compression_type == "auto":
            with open(filename, "rb") as file:
                compression_type = "GZIP" if file.read(2) == _GZIP_MAGIC else "none"
        for record in TFRecordDataset(filename, "" if compression_type == "none" else compression_type):
            num_records += 1
            batch.append(record)
            if len(batch) == 4096:
                schema.add(batch)
                batch = []
    except (DataLossError, OSError) as error:
        return FileReport(filename, num_records, compression_type, str(error))
    finally:
        schema.add(batch)
    return FileReport(filename, num_records, compression_type, None)


def _print_files(reports: list[FileReport]) -> None:
    from rich.text import Text

    print_table(
        "Files",
        ["file", "records", "compression", "CRCs"],
        [
            [
                report.filename,
                f"{report.num_records:,}",
                report.compression_type,
                Text("ok", style="green") if report.error is None else Text("bad", style="red"),
            ]
            for report in reports
        ],
        right={"records"},
    )


def _print_schema(schema: ExampleSchema) -> None:
    title = f"Example schema ({schema.num_records:,} records"
    title += f", {schema.num_not_examples:,} not Examples)" if schema.num_not_examples else ")"
    rows = []
    for name in sorted(schema.features):
        stats = schema.features[name]
        kind = "/".join(sorted(stats.kinds))
        rows.append([name, kind, f"{stats.num_records:,}", stats.min_length, stats.max_length])
    print_table(
        title,
        ["feature", "kind", "in records", "min length", "max length"],
        rows,
        right={"in records", "min length", "max length"},
    )
