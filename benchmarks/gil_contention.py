"""Why device prefetch in a thread cannot hide a Python collate on a CPU-only machine: a jitted
step alone against the same step while a background thread collates, places, or both
(issue 15; docs/benchmarks/data.md, "where the time goes").

Run from the repository root (one process, JAX on CPU, about 30 s):

    python benchmarks/gil_contention.py [--rounds 5] [--batches 150] [--switch-interval S] [--no-picture]

The step and data are those of benchmarks/prefetch.py (a 512-wide MLP, batch 256, samples as
dicts of NumPy rows). Each round times one pass of ``--batches`` steps over pre-placed arrays for
every variant, in order: the step alone; with a thread that collates batches (256
``__getitem__`` calls and ``np.stack``) back to back, 0.5 ms apart; with one that only places
ready NumPy batches (``jax.device_put``); with one doing both. Then, for information, each part
alone: the step's call until it returns (Python in ``nnx.jit`` and the dispatch), the collate,
the placement. ``--switch-interval`` sets ``sys.setswitchinterval`` first (CPython's default:
0.005 s). Prints min, median, max and the median against the step alone (ms per step), and
draws every round in docs/benchmarks/img/gil-contention.png (``--no-picture``: not).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot  # noqa: E402  (benchmarks/ is not a package)
from mdtable import spread, table  # noqa: E402
from prefetch import mlp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--switch-interval", type=float, default=None)
    plot.add_option(parser)
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    dim, size, count = args.dim, args.batch, args.batches

    model = mlp(dim)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    xs = rng.standard_normal((size * count, dim), dtype=np.float32)
    ys = rng.standard_normal((size * count, 1), dtype=np.float32)

    def collate(i: int):
        samples = [{"x": xs[j], "y": ys[j]} for j in range(i * size, (i + 1) * size)]
        return np.stack([s["x"] for s in samples]), np.stack([s["y"] for s in samples])

    host = [collate(i) for i in range(count)]
    placed = [tuple(jnp.asarray(a) for a in batch) for batch in host]

    def steps() -> None:
        for x, y in placed:
            step(model, optimizer, x, y).block_until_ready()

    def with_thread(work: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            stop = threading.Event()

            def background() -> None:
                i = 0
                while not stop.is_set():
                    work(i % count)
                    i += 1
                    time.sleep(0.0005)

            thread = threading.Thread(target=background, daemon=True)
            thread.start()
            try:
                steps()
            finally:
                stop.set()
                thread.join()
        return run

    def place(i: int) -> None:
        jax.block_until_ready(jax.device_put(host[i]))

    def call_only() -> float:
        held = 0.0
        for x, y in placed:
            t0 = time.perf_counter()
            loss = step(model, optimizer, x, y)
            held += time.perf_counter() - t0
            loss.block_until_ready()
        return held

    def each(work: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            for i in range(count):
                work(i)
        return run

    def collate_and_place(i: int) -> None:
        jax.block_until_ready(jax.device_put(collate(i)))

    variants: Dict[str, Callable[[], object]] = {
        "step alone": steps,
        "step + a thread collating": with_thread(collate),
        "step + a thread placing ready batches": with_thread(place),
        "step + a thread collating and placing": with_thread(collate_and_place),
        "[info] the step's call until it returns": call_only,
        "[info] collate alone": each(collate),
        "[info] placement alone": each(place),
    }
    for run in variants.values():  # warm-up (compilation)
        run()
    times: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            t0 = time.perf_counter()
            held = run()  # a float: the variant timed only part of its pass
            times[name].append(held if held is not None else time.perf_counter() - t0)
    reference = statistics.median(times["step alone"])
    print(f"jax {jax.__version__}, {count} steps of batch {size} x {dim}, {args.rounds} rounds, "
          f"switch interval {sys.getswitchinterval():g} s (ms per step)")
    print(table(["variant", "min", "median", "max", "median / step alone"], "lrrrr",
                [[name, *spread(values, reference, scale=1e3 / count)] for name, values in times.items()]))
    if not args.no_picture:
        plot.draw(plot.image("gil-contention"), f"a jitted step beside a Python thread, {count} steps of batch "
                  f"{size} x {dim}", "ms per step",
                  {f"switch interval {sys.getswitchinterval():g} s": {name: [t * 1e3 / count for t in values]
                                                                      for name, values in times.items()}})


if __name__ == "__main__":
    main()
