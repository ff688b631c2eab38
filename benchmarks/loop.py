"""Micro-steps per second of a prepared bf16 + gradient-accumulation loop against the same loop
written with the raw framework, and against Accelerate (torch), in one run.

Run from the repository root:

    python -m benchmarks.loop [--rounds 7] [--windows 6] [--steps 4] [--backends torch,jax] [--no-picture]

For each backend the script launches itself on 2 processes
(``python -m unified launch -n 2 --backend B benchmarks/loop.py --worker ...``). Every contender
trains its own copy of the same MLP on the same pre-generated batches; a round times
``--windows`` accumulation windows of ``--steps`` micro-batches per contender, the contenders'
order rotating every round (so drift in machine load hits all alike) after one untimed warm-up
round (`runner.interleaved`: Python's garbage collected and a barrier before every timing).
Process 0 prints one JSON line; the parent prints a table of min / median / max seconds per
micro-step and each median's ratio to the raw loop, and draws them (every round) in
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
import contextlib
import os
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from benchmarks import plot
from benchmarks.runner import cells, emit, interleaved, main_launched
from benchmarks.runner import table as markdown_table

FEATURES, HIDDEN, BATCH = 256, 512, 64  # BATCH rows per process and micro-batch


def _batches(rank: int, count: int) -> List[tuple]:
    rng = np.random.default_rng(rank)
    return [(rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
             rng.standard_normal((BATCH, 1)).astype(np.float32)) for _ in range(count)]


def _time_rounds(contenders: Dict[str, Callable[[int], None]], rounds: int, micro_steps: int,
                 barrier: Callable[[], None]) -> Dict[str, dict]:
    """Seconds per micro-step of each contender (`runner.interleaved`: one warm-up round for the
    compilation, allocator and DDP buckets, then rounds in rotated order), every process starting
    together and the timing ending when the last one is done."""
    def window(run: Callable[[int], None]) -> Callable[[], None]:
        def timed_window() -> None:
            run(micro_steps)
            barrier()
        return timed_window

    samples = interleaved({name: window(run) for name, run in contenders.items()}, rounds, sync=barrier)
    return {name: {"median_s": statistics.median(v), "samples": v}
            for name, v in ((name, [s / micro_steps for s in values]) for name, values in samples.items())}


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
            with raw_model.no_sync() if not boundary else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = raw_model(x)
                loss = (out.float() - y).pow(2).mean() / steps
                loss.backward()
            if boundary:
                raw_opt.step()
                raw_opt.zero_grad()

    def accumulating(accelerator: Any) -> Callable[[int], None]:
        """Accelerate's idiom, on ours or on Accelerate's ``Accelerator`` (the same script)."""
        model = mlp()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

        def run(n: int) -> None:
            for i in range(n):
                x, y = data[i % len(data)]
                with accelerator.accumulate(model):
                    accelerator.backward((model(x) - y).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
        return run

    contenders = {"raw": raw, "unified": accumulating(ours)}
    try:
        import accelerate
    except ImportError:
        accelerate = None
    if accelerate is not None:
        contenders["accelerate"] = accumulating(
            accelerate.Accelerator(mixed_precision="bf16", gradient_accumulation_steps=steps, cpu=True))
    return ours, contenders, (lambda: dist.barrier())


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
        def put(a):
            h = np.asarray(a)
            return jax.make_array_from_callback(a.shape, replicated, lambda i: h[i])

        return jax.tree.map(put, tree)

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
        emit({"backend": backend, "num_processes": accelerator.num_processes, "steps": args.steps,
              "micro_steps": micro_steps, "rounds": args.rounds, "stats": stats})
    accelerator.end_training()


# -- parent ------------------------------------------------------------------------------------------
def table(results: List[dict]) -> str:
    rows = []
    for result in results:
        raw = result["stats"]["raw"]["median_s"]
        for name, s in result["stats"].items():
            rows.append([result["backend"], name,
                         *cells(s["samples"], "min median max ratio", raw, scale=1e3, digits=2)])
    return markdown_table(["backend", "loop", "min (ms/micro-step)", "median", "max", "median / raw"], "llrrrr", rows)


def show(results: List[dict], picture: bool) -> None:
    """The table; docs/benchmarks/img/loop.png: each backend's loops, ms per micro-step of every round."""
    print(table(results))
    if picture:
        samples = {f"{r['backend']} ({r['num_processes']} processes, N={r['steps']})":
                   {name: [x * 1e3 for x in s["samples"]] for name, s in r["stats"].items()} for r in results}
        plot.draw(plot.image("loop"), "bf16 + gradient accumulation loop, per micro-step", "ms / micro-step", samples)


def main(argv: Optional[List[str]] = None) -> int:
    return main_launched(__doc__, argv, __file__, worker, {"rounds": (7, "timed rounds per contender"),
                                                           "windows": (6, "accumulation windows per round"),
                                                           "steps": (4, "gradient_accumulation_steps")}, 900.0,
                         lambda r: f"{r['num_processes']} processes, {r['rounds']} rounds of {r['micro_steps']} "
                                   f"micro-steps (N={r['steps']})", show)


if __name__ == "__main__":
    sys.exit(main())
