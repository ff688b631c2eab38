"""Data loading: skipping batches on resume, and the per-batch cost of a prepared loader.

Run from the repository root (one process; the JAX part runs in a child process):

    python -m benchmarks.data [--rounds 7] [--skip-samples 6400000] [--no-jax] [--no-picture]

Besides its tables it draws docs/benchmarks/img/data-skip.png, data-iterable.png,
data-overhead.png and data-overhead-jax.png (one per table; ``--no-picture``: none).

What is measured (all single-process, CPU, ``num_workers=0``):

1. Map-style skip. A dataset of tiny samples (``__getitem__`` returns ``np.int64(i)`` and counts
   its calls), batch 32, shuffled. Time from the call to ``next(iter(skip_first_batches(loader,
   100_000)))`` until the first batch is returned, and ``__getitem__`` calls by then.
   * ours: ``unified.Accelerator(backend="torch").prepare(unified.DataLoader(ds, 32, shuffle=True,
     seed=0))`` and ``acc.skip_first_batches``; the epoch's permutation (``loader.epoch_order``)
     is timed again on its own (index lists are made lazily, one per batch).
   * Accelerate: ``accelerate.skip_first_batches(accelerator.prepare(torch DataLoader(ds, 32,
     shuffle=True)), 100_000)`` (a ``SkipBatchSampler`` that draws and drops 100,000 index lists).
   Two dataset sizes: the epoch just longer than the skip (1,000 batches left) and
   ``--skip-samples`` (default 6,400,000: 100,000 batches left, a resume in mid-epoch).
2. Iterable skip: a torch ``IterableDataset`` counting the items it yields, batch 8, skip 1,000.
   Accelerate reads and drops; ours reads and drops a plain stream on the host, and resumes a
   stream that has ``state_dict``/``load_state_dict`` from its state without reading it.
3. Per-batch overhead: 2,000 batches of 64 float32 vectors of 256 (one full epoch, so every
   loader's start-of-epoch work is included) for a plain torch ``DataLoader(shuffle=True)``, the
   same loader prepared by us, a prepared ``unified.DataLoader`` and (info) Accelerate's prepared
   loader and a hand-written NumPy loop + ``torch.from_numpy``. After a warm-up epoch of each,
   ``--rounds`` epochs of every variant, interleaved in blocks of 50 batches (the order rotated
   every block; `runner.interleaved`); medians of per-epoch times. The JAX backend is
   measured the same way in a child process: a prepared ``unified.DataLoader`` yielding
   ``jax.Array`` vs a plain loop building the same NumPy batches and calling ``jnp.asarray``
   (each batch ``block_until_ready``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable, Dict, Iterator, List

import numpy as np

from benchmarks import plot
from benchmarks.runner import Run, clocked, emit, interleaved, module, print_command, run_part, table

SKIP = 100_000
BATCH = 32


class CountingDataset:
    """Map-style dataset of tiny samples: sample ``i`` is ``np.int64(i)``; counts loads."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.int64:
        self.calls += 1
        return np.int64(i)


class VectorDataset:
    """Map-style dataset of float32 vectors of 256."""

    def __init__(self, n: int, dim: int = 256) -> None:
        self.data = np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.data[i]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


# -- 1. map-style skip ------------------------------------------------------------------------------
def bench_map_skip(n: int, acc: Any, hf: Any) -> List[Dict[str, Any]]:
    import accelerate
    import torch

    import unified

    rows = []
    left = n // BATCH - SKIP

    # ours
    ds = CountingDataset(n)
    loader = acc.prepare(unified.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=0))
    first, total = clocked(lambda: next(iter(acc.skip_first_batches(loader, SKIP))))
    calls = ds.calls
    order, t_perm = clocked(loader.epoch_order, 0)
    correct = first.tolist() == loader.batch_indices(order, SKIP)
    rows.append(dict(n=n, left=left, who="ours (`unified.DataLoader`, torch backend)", total=total, calls=calls,
                     detail=f"the epoch's permutation {_ms(t_perm)} ms (timed apart); index lists made lazily",
                     correct=correct))

    # Accelerate
    ds_h = CountingDataset(n)
    dl = hf.prepare(torch.utils.data.DataLoader(ds_h, batch_size=BATCH, shuffle=True))
    batch, total_h = clocked(lambda: next(iter(accelerate.skip_first_batches(dl, SKIP))))
    rows.append(dict(n=n, left=left, who=f"Accelerate {accelerate.__version__} `skip_first_batches`", total=total_h,
                     calls=ds_h.calls, detail=f"{ds_h.calls} = first batch + 1 look-ahead batch (`DataLoaderShard`)",
                     correct=len(batch) == BATCH))
    return rows


# -- 2. iterable skip ---------------------------------------------------------------------------------
def bench_iterable_skip(acc: Any, hf: Any) -> List[Dict[str, Any]]:
    import accelerate
    import torch

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self, n: int) -> None:
            self.n, self.read = n, 0

        def __iter__(self):
            for i in range(self.n):
                self.read += 1
                yield torch.tensor(i)

    skip, rows = 1_000, []
    ds = Stream(100_000)
    dl = hf.prepare(torch.utils.data.DataLoader(ds, batch_size=8))
    batch, total = clocked(lambda: next(iter(accelerate.skip_first_batches(dl, skip))))
    rows.append(dict(who=f"Accelerate {accelerate.__version__}", total=total, calls=ds.read,
                     detail=f"read and dropped; first batch starts at item {int(batch[0])}"))
    ours = Stream(100_000)
    try:
        loader = acc.prepare(torch.utils.data.DataLoader(ours, batch_size=8))
        _, total = clocked(lambda: next(iter(acc.skip_first_batches(loader, skip))))
        rows.append(dict(who="ours, plain stream", total=total, calls=ours.read,
                         detail="read and dropped on the host (never collated or placed)"))

        class StatefulStream(torch.utils.data.IterableDataset):  # torchdata's protocol
            def __init__(self, n: int) -> None:
                self.n, self.read, self.next = n, 0, 0

            def __iter__(self):
                while self.next < self.n:
                    i, self.next = self.next, self.next + 1
                    self.read += 1
                    yield torch.tensor(i)

            def state_dict(self):
                return {"next": self.next}

            def load_state_dict(self, state):
                self.next = state["next"]

        saved = {"epoch": 0, "position": skip, "global_batch_size": 8, "iterable": True,
                 "dataset": {"next": skip * 8}}  # what save_state records after 1,000 batches
        stateful = StatefulStream(100_000)
        loader = acc.prepare(torch.utils.data.DataLoader(stateful, batch_size=8))
        batch, total = clocked(lambda: (loader.load_state_dict(saved),
                                        next(iter(acc.skip_first_batches(loader, skip))))[1])
        rows.append(dict(who="ours, stream with `state_dict` (resumed by `load_state`)", total=total,
                         calls=stateful.read,
                         detail=f"resumed from the dataset's state; first batch starts at item {int(batch[0])}"))
    except NotImplementedError as err:
        rows.append(dict(who="ours", total=None, calls=None,
                         detail=f"not supported yet (`NotImplementedError`: {str(err).split(';')[0]})"))
    return rows


# -- 3. per-batch overhead ------------------------------------------------------------------------------
def _interleave(variants: Dict[str, Callable[[], Iterator[Any]]], rounds: int, batches: int,
                block: int = 50) -> Dict[str, List[List[float]]]:
    """A warm-up epoch of every variant, then ``rounds`` epochs of each, interleaved: blocks of
    ``block`` batches from each variant in turn, the order rotated every block, each block timed
    (`runner.interleaved`; an epoch's iterator stays open across its blocks).

    Returns, per variant, per round, the block times in seconds; the first block of a round
    includes the start of the epoch (``iter()`` and the first batch).
    """
    per_epoch = batches // block

    def blocks(name: str, make: Callable[[], Iterator[Any]]) -> Callable[[], float]:
        epoch: Dict[str, Any] = {"it": None, "blocks": 0}

        def fetch() -> None:
            if epoch["it"] is None:
                epoch["it"] = iter(make())
            for _ in range(block):
                next(epoch["it"])

        def run() -> float:
            seconds = clocked(fetch)[1]
            epoch["blocks"] += 1
            if epoch["blocks"] == per_epoch:
                for _ in epoch["it"]:  # must be exhausted: one epoch each
                    raise AssertionError(f"{name} yielded more than {batches} batches")
                epoch.update(it=None, blocks=0)
            return seconds
        return run

    got = interleaved({name: blocks(name, make) for name, make in variants.items()}, rounds * per_epoch,
                      warmup=per_epoch)
    return {name: [times[i:i + per_epoch] for i in range(0, len(times), per_epoch)] for name, times in got.items()}


def bench_overhead_torch(acc: Any, hf: Any, rounds: int, batches: int) -> Dict[str, List[float]]:
    import torch

    import unified

    bsz = 64
    ds = VectorDataset(batches * bsz)
    raw = torch.utils.data.DataLoader(ds, batch_size=bsz, shuffle=True, num_workers=0)
    ours_torch = acc.prepare(torch.utils.data.DataLoader(ds, batch_size=bsz, shuffle=True, num_workers=0))
    ours_unified = acc.prepare(unified.DataLoader(ds, batch_size=bsz, shuffle=True, seed=0))
    hf_loader = hf.prepare(torch.utils.data.DataLoader(ds, batch_size=bsz, shuffle=True, num_workers=0))
    rng = np.random.default_rng(0)

    def numpy_loop():
        order = rng.permutation(len(ds))
        for k in range(batches):
            yield torch.from_numpy(np.stack([ds[int(i)] for i in order[k * bsz:(k + 1) * bsz]]))

    for loader in (raw, ours_torch, ours_unified, hf_loader):
        assert len(loader) == batches, len(loader)
    return _interleave({
        "plain torch `DataLoader`": lambda: iter(raw),
        "ours: prepared torch `DataLoader`": lambda: iter(ours_torch),
        "ours: prepared `unified.DataLoader`": lambda: iter(ours_unified),
        "info: Accelerate prepared torch `DataLoader`": lambda: iter(hf_loader),
        "info: plain NumPy loop + `torch.from_numpy`": numpy_loop,
    }, rounds, batches)


def jax_worker(rounds: int, batches: int) -> None:
    import jax
    import jax.numpy as jnp

    import unified

    acc = unified.Accelerator(backend="jax")
    bsz = 64
    ds = VectorDataset(batches * bsz)
    ours = acc.prepare(unified.DataLoader(ds, batch_size=bsz, shuffle=True, seed=0))
    rng = np.random.default_rng(0)

    def plain():
        order = rng.permutation(len(ds))
        for k in range(batches):
            x = jnp.asarray(np.stack([ds[int(i)] for i in order[k * bsz:(k + 1) * bsz]]))
            x.block_until_ready()
            yield x

    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(acc.mesh, PartitionSpec("data"))

    def loop(put):
        def run():
            order = rng.permutation(len(ds))
            for k in range(batches):
                x = put(np.stack([ds[int(i)] for i in order[k * bsz:(k + 1) * bsz]]))
                x.block_until_ready()
                yield x
        return run

    def prepared():
        for x in ours:
            x.block_until_ready()
            yield x

    first = next(iter(prepared()))
    assert isinstance(first, jax.Array) and first.shape == (bsz, 256), (type(first), first.shape)
    ours.set_epoch(0)
    times = _interleave({
        "plain NumPy loop + `jnp.asarray`": plain,
        "ours: prepared `unified.DataLoader` (jax)": prepared,
        "info: NumPy loop + `jax.make_array_from_process_local_data` (what `place_batch` calls)":
            loop(lambda x: jax.make_array_from_process_local_data(sharding, x)),
        "info: NumPy loop + `jax.device_put(x, same NamedSharding)`": loop(lambda x: jax.device_put(x, sharding)),
    }, rounds, batches)
    emit({"times": times, "jax": jax.__version__, "devices": str(jax.devices())})


def bench_overhead_jax(rounds: int, batches: int) -> Dict[str, Any]:
    return run_part(module("data", "--jax-worker", "--rounds", str(rounds), "--batches", str(batches)),
                    {"JAX_PLATFORMS": "cpu"}, timeout=240, quiet=True)


def _overhead_table(times: Dict[str, List[List[float]]], batches: int, baseline: str) -> str:
    """Steady state: median over all blocks after the first of each epoch. Epoch start: median
    over epochs of (first block - steady block). Incl. start: median over epochs of the epoch's
    total time / batches."""
    stats = {}
    for name, rounds in times.items():
        block = batches // len(rounds[0])
        steady = statistics.median([t for blocks in rounds for t in blocks[1:]]) / block
        start = statistics.median([blocks[0] - steady * block for blocks in rounds])
        total = statistics.median([sum(blocks) for blocks in rounds]) / batches
        stats[name] = (steady, start, total)
    b_steady, _, b_total = stats[baseline]
    rows = [[name, f"{steady * 1e6:,.1f}", f"{start * 1e3:,.2f}", f"{total * 1e6:,.1f}",
             "—" if name == baseline else f"{(steady / b_steady - 1) * 100:+.1f}%",
             "—" if name == baseline else f"{(total / b_total - 1) * 100:+.1f}%"]
            for name, (steady, start, total) in stats.items()]
    return table(["loader", "steady state per batch (µs)", "epoch start (ms)", "per batch incl. epoch start (µs)",
                  "overhead vs plain (steady)", "overhead vs plain (incl. start)"], "lrrrrr", rows)


def _label(name: str) -> str:
    return name.replace("`", "")


def _overhead_picture(part: str, title: str, times: Dict[str, List[List[float]]], batches: int) -> None:
    """Per epoch, µs per batch over the whole epoch and in the steady state (`_overhead_rows`)."""
    samples: Dict[str, Dict[str, List[float]]] = {"whole epoch": {}, "steady state (epoch start left out)": {}}
    for name, rounds in times.items():
        block = batches // len(rounds[0])
        samples["whole epoch"][_label(name)] = [sum(blocks) / batches * 1e6 for blocks in rounds]
        samples["steady state (epoch start left out)"][_label(name)] = [
            statistics.median(blocks[1:]) / block * 1e6 for blocks in rounds if len(blocks) > 1]
    plot.draw(plot.image("data", part), title, "µs per batch", samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=2_000)
    parser.add_argument("--skip-samples", type=int, default=6_400_000)
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--jax-worker", action="store_true")
    plot.add_option(parser)
    args = parser.parse_args()
    if args.jax_worker:
        jax_worker(args.rounds, args.batches)
        return

    import accelerate
    import torch

    import unified

    print_command()
    run = Run()
    acc = unified.Accelerator(backend="torch")
    hf = accelerate.Accelerator(cpu=True)
    print(f"# Data-loading benchmark\n\nPython {sys.version.split()[0]}, torch {torch.__version__}, "
          f"accelerate {accelerate.__version__}, numpy {np.__version__}; {os.cpu_count()} CPUs; "
          f"load average at start {run.load:.1f}\n", flush=True)

    print(f"## 1. Skip {SKIP:,} batches of a map-style dataset (batch {BATCH}, shuffled), time to the first batch\n")
    skips: Dict[str, Dict[str, List[float]]] = {}
    rows = []
    for n in (BATCH * (SKIP + 1_000), args.skip_samples):
        for row in bench_map_skip(n, acc, hf):
            skips.setdefault(f"{n:,} samples ({row['left']:,} batches left)", {})[_label(row["who"])] = [
                row["total"] * 1e3]
            loaded = row["calls"] - (2 * BATCH if row["who"].startswith("Accelerate") else BATCH)
            rows.append([f"{n:,} ({row['left']:,})", row["who"], _ms(row["total"]), row["calls"], loaded,
                         row["detail"] + ("" if row["correct"] else "; WRONG FIRST BATCH")])
    print(table(["dataset (batches left after skip)", "loader", "time to first batch (ms)", "`__getitem__` calls",
                 "skipped batches loaded", "notes"], "llrrrl", rows))
    print("\nTargets (ours): 0 skipped batches loaded; < 50 ms to the first batch.\n")

    print("## 2. Skip 1,000 batches of an iterable dataset (torch `IterableDataset`, batch 8)\n")
    streams: Dict[str, List[float]] = {}
    rows = []
    for row in bench_iterable_skip(acc, hf):
        if row["total"] is not None:
            streams[_label(row["who"])] = [row["total"] * 1e3]
        rows.append([row["who"], "—" if row["total"] is None else _ms(row["total"]),
                     "—" if row["calls"] is None else f"{row['calls']:,}", row["detail"]])
    print(table(["loader", "time to first batch (ms)", "items read", "notes"], "lrrl", rows), flush=True)

    print(f"\n## 3. Per-batch cost over one epoch of {args.batches:,} batches (64 x float32[256], shuffled, "
          f"num_workers=0); {args.rounds} epochs per loader, interleaved in blocks of 50 batches\n")
    times = bench_overhead_torch(acc, hf, args.rounds, args.batches)
    print(_overhead_table(times, args.batches, "plain torch `DataLoader`"), flush=True)
    if not args.no_jax:
        res = bench_overhead_jax(args.rounds, args.batches)
        print(f"\nJAX backend (for information; JAX {res['jax']}, devices {res['devices']}, child process):\n")
        print(_overhead_table(res["times"], args.batches, "plain NumPy loop + `jnp.asarray`"))
    print("\nTarget: prepared-loader overhead < 3%.")
    print(f"\nTotal runtime {run.elapsed():.0f} s; load average at end {os.getloadavg()[0]:.1f}")
    if not args.no_picture:
        plot.draw(plot.image("data", "skip"), f"skip {SKIP:,} batches of a map-style dataset (batch {BATCH}): "
                  "time to the first batch", "ms (log scale)", skips, log=True)
        plot.draw(plot.image("data", "iterable"), "skip 1,000 batches of an iterable dataset (batch 8): "
                  "time to the first batch", "ms (log scale)", {"iterable dataset": streams}, log=True)
        per = f"{args.batches:,} batches of 64 x float32[256]"
        _overhead_picture("overhead", f"per-batch cost of a prepared loader, torch backend, {per}", times, args.batches)
        if not args.no_jax:
            _overhead_picture("overhead-jax", f"per-batch cost of a prepared loader, JAX backend, {per}", res["times"],
                              args.batches)


if __name__ == "__main__":
    main()
