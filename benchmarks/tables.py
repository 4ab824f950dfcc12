"""A benchmark's rows as a rich table, one rule for all: the first column left, numbers right, floats
to three significant digits."""

from __future__ import annotations

from rich.table import Table


def table(title: str, columns: list[str], rows: list[list]) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        t.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r])
    return t
