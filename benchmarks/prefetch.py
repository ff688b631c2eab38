"""Feeding a jitted training step: a prepared loader with and without device prefetch against
pre-placed arrays (issue 15; goal: prefetched within 3% of pre-placed).

Run from the repository root (one process, JAX on CPU):

    python -m benchmarks.prefetch [--rounds 9] [--batches 200] [--batch 256] [--dim 512] [--no-picture]

After a warm-up pass of each (compilation), each round times one pass of ``--batches`` steps for
every variant, in an order rotated per round (`runner.interleaved`): (1) the step over global
``jax.Array`` batches placed before the timing (the limit: no loading in the loop at all), (2)
the step fed by ``accelerator.prepare(unified.DataLoader(..., prefetch=0))`` (collate +
``make_array_from_process_local_data`` on the step's critical path), (3) the same with
``prefetch=2`` (placed in a background thread), and, for information, (4) the loader alone with
nothing to do per batch and (5) the time the step's call holds the caller before it returns
(Python and dispatch: host work that a producer thread's collate competes with for the GIL).
Every step is ``block_until_ready``-ed. Reports min, median and spread (max/min) per variant and
each median against the limit, and draws every round in docs/benchmarks/img/prefetch.png
(``--no-picture``: not).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable, Dict, Iterable, List

import numpy as np

from benchmarks import plot
from benchmarks.runner import cells, clocked, interleaved, print_command, table


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


def jitted_step() -> Callable[..., Any]:
    """``step(model, optimizer, batch)``: one jitted SGD step on a ``{"x", "y"}`` batch; the loss."""
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return step


def steps_over(step: Callable[..., Any], model: Any, optimizer: Any, batches: Iterable[Any]) -> Callable[[], None]:
    """A pass of ``step`` over ``batches`` (each step waited for)."""
    def run() -> None:
        for batch in batches:
            step(model, optimizer, batch).block_until_ready()
    return run


def host_time(step: Callable[..., Any], model: Any, optimizer: Any, batches: Iterable[Any]) -> Callable[[], float]:
    """Seconds the step's call held the caller (Python + enqueue) before it returned, summed over
    a pass: the step's own host work, which competes with a producer thread's for the GIL."""
    def run() -> float:
        held = 0.0
        for batch in batches:
            loss, seconds = clocked(step, model, optimizer, batch)
            held += seconds
            loss.block_until_ready()
        return held
    return run


def per_step(times: Dict[str, List[float]], steps: int, reference: str, columns: str, ratio: str,
             picture: Any = None) -> str:
    """The table of pass times (``times``: variant -> seconds per pass) in ms per step, each median
    against ``reference``'s (``columns`` of `runner.cells`); ``picture``: ``(part, title, group)``
    of the picture drawn from them."""
    scale = 1e3 / steps
    header = {"min": "min", "median": "median", "max": "max", "spread": "spread (max/min)", "ratio": ratio}
    text = table(["variant", *(header[c] for c in columns.split())], "l" + "r" * len(columns.split()),
                 [[name, *cells(values, columns, statistics.median(times[reference]), scale=scale, spread_digits=2)]
                  for name, values in times.items()])
    if picture:
        part, title, group = picture
        plot.draw(plot.image(part), title, "ms per step",
                  {group: {n: [t * scale for t in v] for n, v in times.items()}})
    return text


def step_parser(doc: str, rounds: int, batches: int) -> argparse.ArgumentParser:
    """The options of the benchmarks of a jitted step (this one and gil_contention.py)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--batches", type=int, default=batches)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=512)
    plot.add_option(parser)
    return parser


def main() -> None:
    args = step_parser(__doc__, 9, 200).parse_args()
    print_command()

    import jax
    import optax
    from flax import nnx

    import unified

    acc = unified.Accelerator(backend="jax", seed=0)
    model = mlp(args.dim)
    model, optimizer = acc.prepare(model, nnx.Optimizer(model, optax.sgd(1e-4), wrt=nnx.Param))
    step = jitted_step()
    dataset = Vectors(args.batch * args.batches, args.dim)
    loaders = {p: acc.prepare(unified.DataLoader(dataset, batch_size=args.batch, prefetch=p)) for p in (0, 2)}
    placed = [b for b in loaders[0]]  # one epoch placed ahead of every timing
    jax.block_until_ready(placed)

    def loader_only() -> None:
        for batch in loaders[0]:
            jax.block_until_ready(batch)

    times = interleaved({"step on pre-placed arrays (limit)": steps_over(step, model, optimizer, placed),
                         "prepared loader, prefetch=0": steps_over(step, model, optimizer, loaders[0]),
                         "prepared loader, prefetch=2": steps_over(step, model, optimizer, loaders[2]),
                         "[info] loader alone, prefetch=0": loader_only,
                         "[info] the step's call until it returns (host work per step)":
                             host_time(step, model, optimizer, placed)}, args.rounds)
    print(f"jax {jax.__version__}, {args.batches} steps of batch {args.batch} x {args.dim}, {args.rounds} rounds "
          f"(ms per step)")
    print(per_step(times, args.batches, "step on pre-placed arrays (limit)", "min median max spread ratio",
                   "median / limit", None if args.no_picture else (
                       "prefetch", f"a jitted step fed by a prepared loader, {args.batches} steps of batch "
                       f"{args.batch} x {args.dim}", f"jax {jax.__version__}")))
    acc.end_training()


if __name__ == "__main__":
    main()
