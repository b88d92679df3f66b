"""What a benchmark writes: Markdown tables, CSV rows, figures (matplotlib, no display)."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table, readable as plain text too: the cells as they are formatted."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(points: Sequence[Any], row_type: type, path: Path) -> None:
    """One row per point (an instance of the dataclass `row_type`), one column per field."""
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=[f.name for f in fields(row_type)])
        writer.writeheader()
        writer.writerows(asdict(point) for point in points)


@contextmanager
def figure(path: Path, title: str, panels: int = 1, size: tuple[float, float] = (10, 4)) -> Iterator[Any]:
    """The axes of a figure of `panels` side by side (one Axes, or a list); saved to `path` under
    `title` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawing, axes = plt.subplots(1, panels, figsize=size)
    try:
        yield axes
        drawing.suptitle(title, fontsize=9)
        drawing.tight_layout()
        drawing.savefig(path, dpi=120)
    finally:
        plt.close(drawing)
