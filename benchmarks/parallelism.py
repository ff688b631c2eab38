"""Step time of a tensor-parallel training loop on CPU: unified's ``ParallelismConfig(tp_size=2)``
against the same loop written with torch's own APIs, in one launched group.

Run from the repository root:

    python -m benchmarks.parallelism [--rounds 7] [--steps 10] [--hidden 1024]

The script launches itself on 2 processes (``python -m unified launch -n 2 --backend torch
benchmarks/parallelism.py --worker ...``, as benchmarks/loop.py). Both contenders train their own
copy of the same model (two MLP blocks, FEATURES -> HIDDEN -> FEATURES each, the first Linear of a
block split by columns over the 2 processes, the second by rows; AdamW) on the same pre-generated
batches (every process of the tensor-parallel group reads the same batch). A round times
``--steps`` optimizer steps of one contender between two barriers; the contenders' order rotates
every round after one untimed warm-up round (`runner.interleaved`: Python's garbage collected and
a barrier before every timing). Process 0 reports seconds per step and the peak resident memory
a round added (``VmHWM``); the parent prints the table and the verdict against the goal (unified's
median step time within 10% of torch's).

Contenders:

* torch: ``init_process_group("gloo")`` (joined already: the group unified started is reused),
  ``init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))``, ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel``, ``loss.backward()``, ``optimizer.step()``,
  ``optimizer.zero_grad()``.
* unified: ``Accelerator(parallelism_config=ParallelismConfig(tp_size=2))``, the model carrying
  its plan in ``tp_plan``, ``prepare(model, optimizer)``, ``accelerator.backward(loss)``,
  ``optimizer.step()``, ``optimizer.zero_grad()``.

Both run the same number of steps on the same batches from the same initial weights, so their
last losses must agree: the result says so (``same_loss``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable, Dict, List, Optional

import numpy as np

from benchmarks.runner import (
    MB,
    PeakMemory,
    Run,
    cells,
    clocked,
    emit,
    interleaved,
    log,
    print_command,
    run_launched,
    table,
)

FEATURES, BATCH, BLOCKS = 256, 64, 2
GOAL = 1.10  # unified's median step time at most 10% above torch's


def _batches(count: int) -> List[tuple]:
    rng = np.random.default_rng(0)  # the same batches on every process of the tensor-parallel group
    return [(rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
             rng.standard_normal((BATCH, FEATURES)).astype(np.float32)) for _ in range(count)]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from unified import Accelerator, ParallelismConfig

    torch.set_num_threads(1)
    hidden = args.hidden

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(FEATURES, hidden), torch.nn.Linear(hidden, FEATURES)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Model(torch.nn.Module):
        tp_plan = {f"blocks.{i}.{name}": style for i in range(BLOCKS)
                   for name, style in (("up", "colwise"), ("down", "rowwise"))}

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=args.processes))
    data = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in _batches(args.steps)]

    # torch's own APIs: the process group (already joined by unified: reused), a mesh, the plan
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    raw_model = parallelize_module(Model(), mesh["tp"], {k: styles[v]() for k, v in Model.tp_plan.items()})
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)
    last: Dict[str, float] = {}

    def raw() -> None:
        for x, y in data:
            loss = torch.nn.functional.mse_loss(raw_model(x), y)
            loss.backward()
            raw_opt.step()
            raw_opt.zero_grad()
        last["torch"] = float(loss.detach())

    model = Model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def ours() -> None:
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        last["unified"] = float(loss.detach())

    def round_of(run: Callable[[], None]) -> Callable[[], dict]:
        def timed_round() -> dict:
            with PeakMemory(anonymous=False) as memory:
                _, seconds = clocked(lambda: (run(), dist.barrier()))
            return {"s": seconds / len(data), "peak_mb": (memory.peak - memory.before) / MB}
        return timed_round

    samples = interleaved({"torch": round_of(raw), "unified": round_of(ours)}, args.rounds,
                          sync=dist.barrier, say=log if accelerator.is_main_process else None)
    if accelerator.is_main_process:
        emit({"num_processes": accelerator.num_processes, "rounds": args.rounds, "steps": args.steps,
              "hidden": hidden, "last_loss": last, "same_loss": abs(last["torch"] - last["unified"]) <= 1e-5,
              "stats": {name: {"samples": [v["s"] for v in values], "peak_mb": max(v["peak_mb"] for v in values),
                               "median_s": statistics.median(v["s"] for v in values)}
                        for name, values in samples.items()}})
    accelerator.end_training()


def report(result: dict) -> str:
    torch_median = result["stats"]["torch"]["median_s"]
    rows = [[name, *cells(s["samples"], "min median max spread ratio", torch_median, scale=1e3, digits=2),
             f"{s['peak_mb']:.1f}"] for name, s in result["stats"].items()]
    ratio = result["stats"]["unified"]["median_s"] / torch_median
    verdict = "met" if ratio <= GOAL else "not met"
    return (table(["loop", "min (ms/step)", "median", "max", "spread", "median / torch", "peak RSS added (MB)"],
                  "lrrrrrr", rows)
            + f"\n\nGoal (unified's median step within {GOAL - 1:.0%} of torch's): {verdict} ({ratio:.3f}x). "
            f"Last losses {result['last_loss']} (same: {result['same_loss']}).")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per contender (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per round (default 10)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width of each block (default 1024)")
    parser.add_argument("--processes", type=int, default=2, help="tp_size = processes (default 2)")
    parser.add_argument("--group-timeout", type=float, default=600.0, help="seconds for the launched group")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    print_command()
    run = Run()
    result = run_launched(__file__, "torch", ["--rounds", str(args.rounds), "--steps", str(args.steps),
                                              "--hidden", str(args.hidden), "--processes", str(args.processes)],
                          args.group_timeout, processes=args.processes)
    if result is None:
        return 1
    log(f"{result['num_processes']} processes, {result['rounds']} rounds of {result['steps']} steps, "
        f"{result['wall_s']:.1f} s")
    print(run.machine(f"torch, {args.processes} processes (gloo), tp_size={args.processes}, hidden {args.hidden}, "
                      f"batch {BATCH} x {FEATURES}, {args.rounds} rounds of {args.steps} steps"))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
