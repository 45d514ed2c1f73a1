"""Markdown tables: one writer for every report that prints one (scaling, simulator, validation)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub markdown table; a column title ending in ``:`` is right-aligned (the colon is dropped).

    Args:
        columns: column titles, e.g. ``["hardware", "GPUs:"]``.
        rows: one sequence of already formatted cells per row, as many as ``columns``.
    """
    titles = [c[:-1] if c.endswith(":") else c for c in columns]
    rule = ["---:" if c.endswith(":") else "---" for c in columns]
    lines = ["| " + " | ".join(titles) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"
