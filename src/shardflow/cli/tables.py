"""The one way the commands print a table: rich, a header rule, numbers right-aligned."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

# Piped output is not wrapped to a terminal's width: each row stays one line for grep, cut and awk.
_UNWRAPPED_WIDTH = 100_000


def print_table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    right: Collection[str] | None = None,
) -> None:
    """Prints `rows` under `columns` to stdout. `right` names the right-aligned columns: all but the first when
    None. Cells are printed as text (never as rich markup) unless they are `rich.text.Text`, which keeps its style.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich would exit with status 1 here; cli/main.py ends every command the same way instead.
            self.quiet = True
            raise BrokenPipeError("the reader of stdout went away")

    right = columns[1:] if right is None else right
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left")
    for row in rows:
        table.add_row(*(cell if isinstance(cell, Text) else Text(str(cell)) for cell in row))
    console = _Console(highlight=False)
    if not console.is_terminal:
        console = _Console(highlight=False, width=_UNWRAPPED_WIDTH)
    console.print(table)
