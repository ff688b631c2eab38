"""Feeding a jitted training step: a prepared loader with and without device prefetch against
pre-placed arrays (issue 15; goal: prefetched within 3% of pre-placed).

Run from the repository root (one process, JAX on CPU):

    python benchmarks/prefetch.py [--rounds 9] [--batches 200] [--batch 256] [--dim 512] [--no-picture]

Each round times one pass of ``--batches`` steps for every variant, in an order rotated per
round: (1) the step over global ``jax.Array`` batches placed before the timing (the limit: no
loading in the loop at all), (2) the step fed by ``accelerator.prepare(unified.DataLoader(...,
prefetch=0))`` (collate + ``make_array_from_process_local_data`` on the step's critical path),
(3) the same with ``prefetch=2`` (placed in a background thread), and, for information, (4) the
loader alone with nothing to do per batch and (5) the time the step's call holds the caller
before it returns (Python and dispatch: host work that a producer thread's collate competes with
for the GIL). Every step is ``block_until_ready``-ed. Reports min,
median and spread (max/min) per variant and each median against the limit, and draws every
round in docs/benchmarks/img/prefetch.png (``--no-picture``: not).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import plot  # noqa: E402  (benchmarks/ is not a package)
from mdtable import spread, table  # noqa: E402


class Vectors:
    def __init__(self, n: int, dim: int) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, dim), dtype=np.float32)
        self.y = rng.standard_normal((n, 1), dtype=np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i]}


def mlp(dim: int) -> Any:
    """The small NNX model these benchmarks train: ``Linear(dim, dim)``, ReLU, ``Linear(dim, 1)``,
    seeded with 0 (also gil_contention.py's)."""
    import jax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.a = nnx.Linear(dim, dim, rngs=rngs)
            self.b = nnx.Linear(dim, 1, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    return MLP(nnx.Rngs(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=512)
    plot.add_option(parser)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import unified

    acc = unified.Accelerator(backend="jax", seed=0)

    model = mlp(args.dim)
    model, optimizer = acc.prepare(model, nnx.Optimizer(model, optax.sgd(1e-4), wrt=nnx.Param))

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(m):
            return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    dataset = Vectors(args.batch * args.batches, args.dim)
    loaders = {p: acc.prepare(unified.DataLoader(dataset, batch_size=args.batch, prefetch=p)) for p in (0, 2)}
    placed = [b for b in loaders[0]]  # one epoch placed ahead of every timing
    jax.block_until_ready(placed)

    def run_placed():
        for batch in placed:
            step(model, optimizer, batch).block_until_ready()

    def run_loader(prefetch):
        def run():
            for batch in loaders[prefetch]:
                step(model, optimizer, batch).block_until_ready()
        return run

    def loader_only():
        for batch in loaders[0]:
            jax.block_until_ready(batch)

    def dispatch_only() -> float:
        """Seconds the step's call held the caller (Python + enqueue) before it returned, summed
        over the pass: the step's own host work, which competes with a producer thread's."""
        held = 0.0
        for batch in placed:
            t0 = time.perf_counter()
            loss = step(model, optimizer, batch)
            held += time.perf_counter() - t0
            loss.block_until_ready()
        return held

    variants = {"step on pre-placed arrays (limit)": run_placed, "prepared loader, prefetch=0": run_loader(0),
                "prepared loader, prefetch=2": run_loader(2), "[info] loader alone, prefetch=0": loader_only,
                "[info] the step's call until it returns (host work per step)": dispatch_only}
    for run in variants.values():  # warm-up (compilation)
        run()
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            held = variants[name]()  # a float: the variant timed only part of its pass
            times[name].append(held if held is not None else time.perf_counter() - t0)
    limit = statistics.median(times[names[0]])
    print(f"jax {jax.__version__}, {args.batches} steps of batch {args.batch} x {args.dim}, {args.rounds} rounds "
          f"(ms per step)")
    per_step = 1e3 / args.batches  # seconds per pass -> ms per step
    print(table(["variant", "min", "median", "max", "spread (max/min)", "median / limit"], "lrrrrr",
                [[name, *spread(times[name], limit, scale=per_step, spread_digits=2)] for name in names]))
    if not args.no_picture:
        plot.draw(plot.image("prefetch"), f"a jitted step fed by a prepared loader, {args.batches} steps of batch "
                  f"{args.batch} x {args.dim}", "ms per step",
                  {f"jax {jax.__version__}": {name: [t * per_step for t in times[name]] for name in names}})
    acc.end_training()


if __name__ == "__main__":
    main()
