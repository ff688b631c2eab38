"""Micro-steps per second of a prepared bf16 + gradient-accumulation loop against the same loop
written with the raw framework, and against Accelerate (torch), in one run.

Run from the repository root:

    python benchmarks/loop.py [--rounds 7] [--windows 6] [--steps 4] [--backends torch,jax] [--no-picture]

For each backend the script launches itself on 2 processes
(``python -m unified launch -n 2 --backend B benchmarks/loop.py --worker ...``). Every contender
trains its own copy of the same MLP on the same pre-generated batches; a round times
``--windows`` accumulation windows of ``--steps`` micro-batches per contender, the contenders'
order rotating every round (so drift in machine load hits all alike) after one untimed warm-up
round. Process 0 prints one JSON line; the parent prints a table of min / median / max seconds
per micro-step and each median's ratio to the raw loop, and draws them (every round) in
docs/benchmarks/img/loop.png (``--no-picture``: not).

Contenders:

* torch raw: ``DistributedDataParallel`` on the same gloo group, ``torch.autocast(bfloat16)``,
  the loss divided by N, ``no_sync`` except on every N-th micro-batch, AdamW step/zero_grad then.
* torch unified: ``Accelerator(mixed_precision="bf16", gradient_accumulation_steps=N)``,
  ``prepare(model, optimizer)``, ``with accelerator.accumulate(model)``, Accelerate's idiom.
* torch accelerate (when installed): the same script on ``accelerate.Accelerator``.
* jax raw: NNX layers built with ``dtype=bfloat16``, ``nnx.Optimizer(optax.MultiSteps(adamw, N))``,
  a jitted step on pre-placed global batches.
* jax unified: ``Accelerator(backend="jax", mixed_precision="bf16", gradient_accumulation_steps=N)``
  preparing float32 layers and a plain adamw ``nnx.Optimizer``, the same jitted step inside
  ``accumulate``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launched import launch_each, report  # noqa: E402  (benchmarks/ is not a package)
import plot  # noqa: E402
from mdtable import spread, table as markdown_table  # noqa: E402

FEATURES, HIDDEN, BATCH = 256, 512, 64  # BATCH rows per process and micro-batch


def _batches(rank: int, count: int) -> List[tuple]:
    rng = np.random.default_rng(rank)
    return [(rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
             rng.standard_normal((BATCH, 1)).astype(np.float32)) for _ in range(count)]


def _time_rounds(contenders: Dict[str, Callable[[int], None]], rounds: int, micro_steps: int,
                 barrier: Callable[[], None]) -> Dict[str, dict]:
    """Seconds per micro-step of each contender, rounds interleaved with a rotating order."""
    names = list(contenders)
    for name in names:  # warm-up: compilation, allocator, DDP buckets
        contenders[name](micro_steps)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            barrier()
            start = time.perf_counter()
            contenders[name](micro_steps)
            barrier()
            samples[name].append((time.perf_counter() - start) / micro_steps)
    return {name: {"min_s": min(v), "median_s": statistics.median(v), "max_s": max(v), "n": len(v), "samples": v}
            for name, v in samples.items()}


# -- torch ---------------------------------------------------------------------------------------
def _torch_contenders(steps: int, micro_steps: int) -> tuple:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unified import Accelerator

    torch.set_num_threads(1)

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                   torch.nn.GELU(), torch.nn.Linear(HIDDEN, 1))

    ours = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=steps)
    rank = ours.process_index
    data = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in _batches(rank, micro_steps)]

    raw_model = DDP(mlp())
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)

    def raw(n: int) -> None:
        for i in range(n):
            x, y = data[i % len(data)]
            boundary = (i + 1) % steps == 0
            context = raw_model.no_sync() if not boundary else _null()
            with context:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = raw_model(x)
                loss = (out.float() - y).pow(2).mean() / steps
                loss.backward()
            if boundary:
                raw_opt.step()
                raw_opt.zero_grad()

    model = mlp()
    u_model, u_opt = ours.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def unified(n: int) -> None:
        for i in range(n):
            x, y = data[i % len(data)]
            with ours.accumulate(u_model):
                loss = (u_model(x) - y).pow(2).mean()
                ours.backward(loss)
                u_opt.step()
                u_opt.zero_grad()

    contenders = {"raw": raw, "unified": unified}
    try:
        import accelerate
    except ImportError:
        accelerate = None
    if accelerate is not None:
        theirs = accelerate.Accelerator(mixed_precision="bf16", gradient_accumulation_steps=steps, cpu=True)
        model = mlp()
        a_model, a_opt = theirs.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

        def accelerate_loop(n: int) -> None:
            for i in range(n):
                x, y = data[i % len(data)]
                with theirs.accumulate(a_model):
                    loss = (a_model(x) - y).pow(2).mean()
                    theirs.backward(loss)
                    a_opt.step()
                    a_opt.zero_grad()

        contenders["accelerate"] = accelerate_loop
    return ours, contenders, (lambda: dist.barrier())


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- jax -------------------------------------------------------------------------------------------
def _jax_contenders(steps: int, micro_steps: int) -> tuple:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from unified import Accelerator

    ours = Accelerator(backend="jax", mixed_precision="bf16", gradient_accumulation_steps=steps)
    rows = NamedSharding(ours.mesh, PartitionSpec("data"))
    data = [tuple(jax.make_array_from_process_local_data(rows, a) for a in pair)
            for pair in _batches(ours.process_index, micro_steps)]

    def mlp(dtype):
        rngs = nnx.Rngs(0)
        return nnx.Sequential(nnx.Linear(FEATURES, HIDDEN, dtype=dtype, rngs=rngs), nnx.gelu,
                              nnx.Linear(HIDDEN, HIDDEN, dtype=dtype, rngs=rngs), nnx.gelu,
                              nnx.Linear(HIDDEN, 1, dtype=dtype, rngs=rngs))

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(m):
            return ((m(x).astype(jnp.float32) - y) ** 2).mean()

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    replicated = NamedSharding(ours.mesh, PartitionSpec())

    def replicate(tree):
        return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, replicated, lambda i, h=np.asarray(a): h[i]), tree)

    raw_model = mlp(jnp.bfloat16)
    raw_opt = nnx.Optimizer(raw_model, optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=steps), wrt=nnx.Param)
    nnx.update(raw_model, replicate(nnx.state(raw_model)))
    nnx.update(raw_opt, replicate(nnx.state(raw_opt)))

    def raw(n: int) -> None:
        for i in range(n):
            step(raw_model, raw_opt, *data[i % len(data)])
        jax.block_until_ready(nnx.state(raw_model))

    model = mlp(None)
    u_model, u_opt = ours.prepare(model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))

    def unified(n: int) -> None:
        for i in range(n):
            with ours.accumulate(u_model):
                step(u_model, u_opt, *data[i % len(data)])
        jax.block_until_ready(nnx.state(u_model))

    return ours, {"raw": raw, "unified": unified}, (lambda: ours.wait_for_everyone())


def worker(args: argparse.Namespace) -> None:
    backend = os.environ.get("UNIFIED_BACKEND", "torch")
    micro_steps = args.windows * args.steps
    build = {"torch": _torch_contenders, "jax": _jax_contenders}[backend]
    accelerator, contenders, barrier = build(args.steps, micro_steps)
    stats = _time_rounds(contenders, args.rounds, micro_steps, barrier)
    if accelerator.is_main_process:
        report({"backend": backend, "num_processes": accelerator.num_processes, "steps": args.steps,
                "micro_steps": micro_steps, "rounds": args.rounds, "stats": stats})
    accelerator.end_training()


# -- parent ------------------------------------------------------------------------------------------
def table(results: List[dict]) -> str:
    rows = []
    for result in results:
        raw = result["stats"]["raw"]["median_s"]
        for name, s in result["stats"].items():
            rows.append([result["backend"], name, *spread(s["samples"], raw, scale=1e3, digits=2)])
    return markdown_table(["backend", "loop", "min (ms/micro-step)", "median", "max", "median / raw"], "llrrrr", rows)


def picture(results: List[dict]) -> None:
    """docs/benchmarks/img/loop.png: each backend's loops, ms per micro-step of every round."""
    samples = {f"{r['backend']} ({r['num_processes']} processes, N={r['steps']})":
               {name: [x * 1e3 for x in s["samples"]] for name, s in r["stats"].items()} for r in results}
    plot.draw(plot.image("loop"), "bf16 + gradient accumulation loop, per micro-step", "ms / micro-step", samples)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per contender (default 7)")
    parser.add_argument("--windows", type=int, default=6, help="accumulation windows per round (default 6)")
    parser.add_argument("--steps", type=int, default=4, help="gradient_accumulation_steps (default 4)")
    parser.add_argument("--backends", default="torch,jax", help="comma-separated (default torch,jax)")
    parser.add_argument("--group-timeout", type=float, default=900.0, help="seconds per backend run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    plot.add_option(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = launch_each(__file__, args.backends, ["--rounds", str(args.rounds), "--windows", str(args.windows),
                                                    "--steps", str(args.steps)], args.group_timeout,
                          lambda r: f"{r['num_processes']} processes, {r['rounds']} rounds of {r['micro_steps']} "
                                    f"micro-steps (N={r['steps']})")
    if results is None:
        return 1
    print(table(results))
    if not args.no_picture:
        picture(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
