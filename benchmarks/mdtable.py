"""The markdown tables the benchmark scripts print: one table builder, and the min / median / max
/ spread / ratio cells of a contender's samples (loop.py, prefetch.py, checkpoint.py's load
comparisons; collectives.py for its table).

Example:
    >>> print(table(["loop", "min (ms)", "median", "max", "median / raw"], "lrrrr",
    ...             [["raw", *spread([1.0, 1.2, 1.1], 1.1, scale=1e3, digits=1)]]))
    | loop | min (ms) | median | max | median / raw |
    |---|---:|---:|---:|---:|
    | raw | 1000.0 | 1100.0 | 1200.0 | 1.000x |
"""
from __future__ import annotations

import statistics
from typing import Iterable, List, Optional, Sequence


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: ``align`` holds one letter per column, ``l`` (``---``) or ``r`` (``---:``)."""
    if len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} letters for {len(header)} columns")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["|" + "|".join(f" {cell} " if str(cell) else " " for cell in row) + "|" for row in rows]
    return "\n".join(lines)


def spread(values: Sequence[float], reference: float, *, scale: float = 1.0, digits: int = 3,
           spread_digits: Optional[int] = None, ratio_digits: int = 3) -> List[str]:
    """The cells min, median, max (each times ``scale``, ``digits`` decimals), then, with
    ``spread_digits``, the spread max / min, and the median's ratio to ``reference`` (a median in
    the unit of ``values``, before ``scale``)."""
    median = statistics.median(values)
    cells = [f"{min(values) * scale:.{digits}f}", f"{median * scale:.{digits}f}", f"{max(values) * scale:.{digits}f}"]
    if spread_digits is not None:
        cells.append(f"{max(values) / min(values):.{spread_digits}f}x")
    return cells + [f"{median / reference:.{ratio_digits}f}x"]
