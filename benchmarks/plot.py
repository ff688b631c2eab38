"""One picture per benchmark: contenders side by side, median bar, min-max whisker.

Every benchmark script calls :func:`draw` with the samples it measured, so the PNG on a
benchmark page is always drawn from the same run as the table below it. matplotlib is an
optional dependency (``pip install -e '.[bench]'``); without it the scripts print their tables
and say that no picture was drawn.

Example:
    >>> draw("docs/benchmarks/img/trigger.png", "check_trigger, 2 processes", "ms",
    ...      {"torch": {"ours": [0.41, 0.40], "raw all-reduce": [0.38, 0.39]}})
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

Samples = Mapping[str, Mapping[str, Sequence[float]]]  # group (e.g. "save") -> contender -> samples


def draw(path: str, title: str, unit: str, samples: Samples, note: Optional[str] = None) -> Optional[Path]:
    """Draw one bar group per key of ``samples`` (contenders in the order given), each bar the
    median with a whisker from min to max, and the sample count under the title. Returns the
    written path, or None (with a printed reason) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no picture: matplotlib is not installed; pip install -e '.[bench]' to draw {path})")
        return None
    groups = [g for g in samples if samples[g]]
    contenders = list(dict.fromkeys(c for g in groups for c in samples[g]))
    width = 0.8 / max(1, len(contenders))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(groups) * max(1, len(contenders)) ** 0.5 + 2), 3.6))
    colours = plt.get_cmap("tab10")
    counts = set()
    for i, contender in enumerate(contenders):
        xs, medians, low, high = [], [], [], []
        for g, group in enumerate(groups):
            values = [float(v) for v in samples[group].get(contender, ())]
            if not values:
                continue
            counts.add(len(values))
            median = statistics.median(values)
            xs.append(g + (i - (len(contenders) - 1) / 2) * width)
            medians.append(median)
            low.append(median - min(values))
            high.append(max(values) - median)
        ax.bar(xs, medians, width * 0.92, label=contender, color=colours(i % 10),
               yerr=[low, high], capsize=3, error_kw={"elinewidth": 1})
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(unit)
    runs = ", ".join(str(c) for c in sorted(counts))
    ax.set_title(f"{title}\n(bar: median, whisker: min-max of {runs} runs)" + (f"; {note}" if note else ""), fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"picture: {out}")
    return out


def as_samples(rows: Dict[str, Dict[str, Sequence[float]]]) -> Samples:
    """Drop empty groups and contenders (a part that did not run) before drawing."""
    return {g: {c: v for c, v in cs.items() if v} for g, cs in rows.items() if any(cs.values())}
