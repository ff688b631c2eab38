"""One picture per benchmark: contenders side by side, median bar, min-max whisker.

Every benchmark script calls :func:`draw` with the samples it measured, so the PNG on a
benchmark page is always drawn from the same run as the table below it. matplotlib is an
optional dependency (``pip install -e '.[bench]'``); without it the scripts print their tables
and say that no picture was drawn. ``--no-picture`` (:func:`add_option`) skips the pictures.

Example:
    >>> draw(image("collectives"), "check_trigger, 2 processes", "ms",
    ...      {"torch": {"ours": [0.41, 0.40], "raw all-reduce": [0.38, 0.39]}})
"""
from __future__ import annotations

import argparse
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

Samples = Mapping[str, Mapping[str, Sequence[float]]]  # group (e.g. "save") -> contender -> samples
IMG = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "img"


def image(script: str, part: Optional[str] = None) -> Path:
    """Where a script's picture goes: ``docs/benchmarks/img/<script>[-<part>].png``."""
    return IMG / (f"{script}-{part}.png" if part else f"{script}.png")


def add_option(parser: argparse.ArgumentParser) -> None:
    """The scripts' ``--no-picture`` flag (``args.no_picture``)."""
    parser.add_argument("--no-picture", action="store_true",
                        help=f"do not draw the pictures (by default written under {IMG.relative_to(IMG.parents[2])}/; "
                             "needs matplotlib: pip install -e '.[bench]')")


def draw(path: str, title: str, unit: str, samples: Samples, note: Optional[str] = None, log: bool = False,
         labels: Optional[Mapping[str, Mapping[str, str]]] = None, subtitle: Optional[str] = None) -> Optional[Path]:
    """Draw one bar group per key of ``samples`` (contenders in the order given), each bar the
    median with a whisker from min to max, and the sample count under the title. ``log``: a
    logarithmic value axis (contenders orders of magnitude apart); ``labels``: a text over some
    bars (group -> contender -> text); ``subtitle``: says what a bar is instead (values that are
    not timed runs). Returns the written path, or None (with a printed reason) when matplotlib
    is not installed or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no picture: matplotlib is not installed; pip install -e '.[bench]' to draw {path})", file=sys.stderr)
        return None
    samples = as_samples({g: dict(cs) for g, cs in samples.items()})
    if not samples:
        print(f"(no picture: no samples for {path})", file=sys.stderr)
        return None
    groups = list(samples)
    contenders = list(dict.fromkeys(c for g in groups for c in samples[g]))
    present = {g: [c for c in contenders if samples[g].get(c)] for g in groups}  # each group centred on its bars
    width = 0.8 / max(1, max(len(p) for p in present.values()))
    # Width for the bars; the legend (below the axes) gets as many columns as fit in it, or one.
    inches = min(13.0, max(5.0, 2 + 0.45 * sum(len(p) for p in present.values()) + 0.3 * len(groups)))
    column = 0.6 + 0.06 * max(len(c) for c in contenders)  # inches of a legend column
    columns = min(len(contenders), 2 if len(contenders) > 3 else len(contenders))
    while columns > 1 and columns * column > max(inches, 7.0):
        columns -= 1
    inches = min(13.0, max(inches, columns * column))
    wrap = max(10, min(30, int((inches - 1) / len(groups) / 0.075)))  # characters of a group name per line
    names = ["\n".join(textwrap.wrap(g, wrap)) for g in groups]
    lines = max(name.count("\n") + 1 for name in names)
    rows = -(-len(contenders) // columns)
    fig, ax = plt.subplots(figsize=(inches, 3.6 + 0.15 * (lines - 1) + 0.2 * rows))
    colours = plt.get_cmap("tab10")
    counts = set()
    for i, contender in enumerate(contenders):
        xs, medians, low, high, texts = [], [], [], [], []
        for g, group in enumerate(groups):
            values = [float(v) for v in samples[group].get(contender, ())]
            if not values:
                continue
            counts.add(len(values))
            median = statistics.median(values)
            slot, count = present[group].index(contender), len(present[group])
            xs.append(g + (slot - (count - 1) / 2) * width)
            medians.append(median)
            low.append(median - min(values))
            high.append(max(values) - median)
            texts.append((labels or {}).get(group, {}).get(contender, ""))
        spread = any(low) or any(high)  # no whisker on single runs
        bars = ax.bar(xs, medians, width * 0.92, label=contender, color=colours(i % 10),
                      yerr=[low, high] if spread else None, capsize=3, error_kw={"elinewidth": 1})
        if any(texts):
            ax.bar_label(bars, texts, fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), names, fontsize=8)
    ax.set_ylabel(unit)
    if log:
        ax.set_yscale("log")
    runs = ", ".join(str(c) for c in sorted(counts))
    how = subtitle or ("one run each" if counts == {1} else f"bar: median, whisker: min-max of {runs} runs")
    ax.set_title(f"{title}\n({how})" + (f"; {note}" if note else ""), fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    # The legend in a strip at the bottom of the figure, below the group names: it covers no bar.
    fig.legend(fontsize=8, frameon=False, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=columns)
    fig.tight_layout(rect=(0.0, (0.2 * rows + 0.1) / fig.get_figheight(), 1.0, 1.0))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"picture: {out}", file=sys.stderr)
    return out


def as_samples(rows: Dict[str, Dict[str, Sequence[float]]]) -> Samples:
    """Drop empty groups and contenders (a part that did not run) before drawing."""
    return {g: {c: v for c, v in cs.items() if v} for g, cs in rows.items() if any(cs.values())}
