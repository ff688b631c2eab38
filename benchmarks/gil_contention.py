"""Why device prefetch in a thread cannot hide a Python collate on a CPU-only machine: a jitted
step alone against the same step while a background thread collates, places, or both
(issue 15; docs/benchmarks/data.md, "where the time goes").

Run from the repository root (one process, JAX on CPU, about 30 s):

    python -m benchmarks.gil_contention [--rounds 5] [--batches 150] [--switch-interval S] [--no-picture]

The step and data are those of benchmarks/prefetch.py (a 512-wide MLP, batch 256, samples as
dicts of NumPy rows). After a warm-up pass of each, each round times one pass of ``--batches``
steps over pre-placed arrays for every variant, in order (`runner.interleaved`): the step alone;
with a thread that collates batches (256 ``__getitem__`` calls and ``np.stack``) back to back,
0.5 ms apart; with one that only places ready NumPy batches (``jax.device_put``); with one doing
both. Then, for information, each part alone: the step's call until it returns (Python in
``nnx.jit`` and the dispatch), the collate, the placement. ``--switch-interval`` sets
``sys.setswitchinterval`` first (CPython's default: 0.005 s). Prints min, median, max and the
median against the step alone (ms per step), and draws every round in
docs/benchmarks/img/gil-contention.png (``--no-picture``: not).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable

import numpy as np

from benchmarks.prefetch import host_time, jitted_step, mlp, per_step, step_parser, steps_over
from benchmarks.runner import interleaved, print_command


def main() -> None:
    parser = step_parser(__doc__, 5, 150)
    parser.add_argument("--switch-interval", type=float, default=None)
    args = parser.parse_args()
    print_command()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    dim, size, count = args.dim, args.batch, args.batches
    model = mlp(dim)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-4), wrt=nnx.Param)
    step = jitted_step()
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((size * count, dim), dtype=np.float32)
    ys = rng.standard_normal((size * count, 1), dtype=np.float32)

    def collate(i: int):
        samples = [{"x": xs[j], "y": ys[j]} for j in range(i * size, (i + 1) * size)]
        return {"x": np.stack([s["x"] for s in samples]), "y": np.stack([s["y"] for s in samples])}

    host = [collate(i) for i in range(count)]
    placed = [{k: jnp.asarray(a) for k, a in batch.items()} for batch in host]
    steps = steps_over(step, model, optimizer, placed)

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

    def each(work: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            for i in range(count):
                work(i)
        return run

    def collate_and_place(i: int) -> None:
        jax.block_until_ready(jax.device_put(collate(i)))

    times = interleaved({
        "step alone": steps,
        "step + a thread collating": with_thread(collate),
        "step + a thread placing ready batches": with_thread(place),
        "step + a thread collating and placing": with_thread(collate_and_place),
        "[info] the step's call until it returns": host_time(step, model, optimizer, placed),
        "[info] collate alone": each(collate),
        "[info] placement alone": each(place),
    }, args.rounds, rotate=False)
    print(f"jax {jax.__version__}, {count} steps of batch {size} x {dim}, {args.rounds} rounds, "
          f"switch interval {sys.getswitchinterval():g} s (ms per step)")
    print(per_step(times, count, "step alone", "min median max ratio", "median / step alone",
                   None if args.no_picture else (
                       "gil-contention",
                       f"a jitted step beside a Python thread, {count} steps of batch {size} x {dim}",
                       f"switch interval {sys.getswitchinterval():g} s")))


if __name__ == "__main__":
    main()
