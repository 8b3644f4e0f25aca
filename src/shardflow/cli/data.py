"""Inspect record files: count records, verify every CRC, and infer the tf.train.Example schema."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    console.print(_files_table(reports))
    if schema.features:
        console.print(_schema_table(schema))
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


def _files_table(reports: list[FileReport]) -> object:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="Files")
    table.add_column("file")
    table.add_column("records", justify="right")
    table.add_column("compression")
    table.add_column("CRCs")
    for report in reports:
        status = "[green]ok[/]" if report.error is None else "[red]bad[/]"
        table.add_row(escape(report.filename), f"{report.num_records:,}", report.compression_type, status)
    return table


def _schema_table(schema: ExampleSchema) -> object:
    from rich.table import Table

    title = f"Example schema ({schema.num_records:,} records"
    title += f", {schema.num_not_examples:,} not Examples)" if schema.num_not_examples else ")"
    table = Table(title=title)
    table.add_column("feature")
    table.add_column("kind")
    table.add_column("in records", justify="right")
    table.add_column("min length", justify="right")
    table.add_column("max length", justify="right")
    for name in sorted(schema.features):
        stats = schema.features[name]
        kind = "/".join(sorted(stats.kinds))
        table.add_row(name, kind, f"{stats.num_records:,}", str(stats.min_length), str(stats.max_length))
    return table
