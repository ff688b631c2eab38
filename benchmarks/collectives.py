"""Per-call latency of `wait_for_everyone` and `check_trigger` against the raw primitives.

Run from the repository root:

    python -m benchmarks.collectives [--iters 2000] [--block 50] [--backends torch,jax] [--no-picture]

For each backend the script launches itself on 2 processes with
``python -m unified launch -n 2 --backend B benchmarks/collectives.py --worker ...``.
Each worker creates ``Accelerator()``, warms up, then measures every call on its own
(``time.perf_counter_ns``), alternating blocks of raw and ours calls (the order rotates every
block, so drift in machine load hits both sides alike; `runner.interleaved`: Python's garbage
collected and a barrier before every block, untimed). Process 0 prints one JSON line with
the medians; the parent prints a markdown table and draws docs/benchmarks/img/collectives.png
(the median of each block of calls as one sample; ``--no-picture``: not).

What is compared:

* torch: ``wait_for_everyone`` vs ``torch.distributed.barrier()``; ``check_trigger`` vs a
  1-element int32 ``all_reduce(op=MAX)`` on the default gloo group (tensor creation and
  ``.item()`` included, as a hand-written trigger needs both).
* jax: ``wait_for_everyone`` vs the coordination-service barrier
  ``global_state.client.wait_at_barrier(key, timeout_ms)``; ``check_trigger`` vs that same
  barrier (our trigger is one barrier whose outcome carries the flag, backends/jax/control.py).
  For information: raw barrier + ``key_value_dir_get`` (the previous two-trip protocol) and a raw device
  all-reduce (one int32 per process via ``jax.make_array_from_process_local_data`` on
  ``Mesh(np.array(jax.devices()), ("data",))`` summed by a jitted function). The other "info"
  rows are the options for a one-round-trip trigger, each by hand: a raw barrier through the
  backend's caller thread (and through one that is not kept on its caller's core), the device
  psum on a thread with a deadline, ``key_value_increment`` + a blocking get, the flag barrier
  with a flag set, and ours with the trigger set.
"""
from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

from benchmarks import plot
from benchmarks.runner import emit, interleaved, main_launched
from benchmarks.runner import table as markdown_table

RAW_TIMEOUT_S = 1800.0  # same as the Accelerator's default timeout


# -- measurement (runs in every worker; all processes run the same call sequence) ----------------
def _measure(pairs: Dict[str, Callable[[], object]], iters: int, block: int, warmup: int,
             sync: Callable[[], None]) -> Dict[str, dict]:
    """Time every call of each function in ``pairs`` (nanoseconds), ``block`` calls of one after
    the other's, the order of the blocks rotated every round (`runner.interleaved`, ``sync()``
    first); ``warmup`` untimed calls of each first (in blocks)."""
    def calls(fn: Callable[[], object]) -> Callable[[], List[int]]:
        def run() -> List[int]:
            clock, out = time.perf_counter_ns, []
            for _ in range(block):
                t0 = clock()
                fn()
                out.append(clock() - t0)
            return out
        return run

    blocks = interleaved({name: calls(fn) for name, fn in pairs.items()}, max(1, iters // block),
                         warmup=-(-warmup // block), sync=sync)
    result = {}
    for name, timed in blocks.items():
        values = sorted(ns for times in timed for ns in times)
        n = len(values)
        result[name] = {
            "median_us": statistics.median(values) / 1e3,
            "p10_us": values[n // 10] / 1e3,
            "p90_us": values[(9 * n) // 10] / 1e3,
            "n": n,
            "block_medians_us": [statistics.median(times) / 1e3 for times in timed],
        }
    return result


def _torch_pairs(accelerator) -> Dict[str, Dict[str, Callable[[], object]]]:
    import torch
    import torch.distributed as dist

    def raw_barrier() -> None:
        dist.barrier()

    def raw_flag() -> bool:
        value = torch.tensor([0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    return {
        "wait_for_everyone": {"ours": accelerator.wait_for_everyone, "raw": raw_barrier},
        "check_trigger": {"ours": accelerator.check_trigger, "raw": raw_flag},
    }


def _jax_pairs(accelerator) -> Dict[str, Dict[str, Callable[[], object]]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.distributed import global_state
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    client = global_state.client
    timeout_ms = int(RAW_TIMEOUT_S * 1000)
    counter = [0]

    def raw_barrier() -> None:
        counter[0] += 1
        client.wait_at_barrier(f"bench/raw #{counter[0]}", timeout_ms)

    def raw_barrier_dir_get() -> bool:
        counter[0] += 1
        key = f"bench/raw #{counter[0]}"
        client.wait_at_barrier(key, timeout_ms)
        return bool(client.key_value_dir_get(f"bench/flag/{key}/"))

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    local = len(jax.local_devices())

    def raw_psum() -> bool:
        flag = np.zeros((local,), dtype=np.int32)
        value = total(jax.make_array_from_process_local_data(sharded, flag))
        return bool(np.asarray(value.addressable_data(0)))

    # The options for a one-round-trip trigger, each by hand (see docs/benchmarks/collectives.md).
    n, me = jax.process_count(), jax.process_index()
    flagged_ids = list(range(n)) + [me]
    last = me == n - 1

    def flag_barrier_fired() -> bool:
        """A barrier on one reused id that a flagged process fails (the last process flags every
        call), then a plain barrier: the path of a set trigger."""
        counter[0] += 1
        try:
            client.wait_at_barrier("bench/flag", timeout_ms, flagged_ids if last else None)
            fired = False
        except Exception:  # noqa: BLE001 - INVALID_ARGUMENT: conflicting participant lists
            fired = True
        client.wait_at_barrier(f"bench/raw #{counter[0]}", timeout_ms)
        return fired

    def increment_then_get() -> bool:
        """key_value_increment counts arrivals (a flag would add n + 1); the last arrival posts
        the outcome, the others wait for it: two round trips."""
        counter[0] += 1
        key = f"bench/count/{counter[0]}"
        if client.key_value_increment(key, 1) == n:
            client.key_value_set(f"{key}/done", "0")
            return False
        return client.blocking_key_value_get(f"{key}/done", timeout_ms) != "0"

    psum_calls: "queue.Queue" = queue.Queue()

    def psum_thread() -> None:
        while True:
            done, out = psum_calls.get()
            out.append(raw_psum())
            done.set()

    threading.Thread(target=psum_thread, daemon=True).start()

    def psum_with_deadline() -> bool:
        """The device all-reduce on a worker thread, the caller waiting for it with a deadline."""
        done, out = threading.Event(), []
        psum_calls.put((done, out))
        if not done.wait(RAW_TIMEOUT_S):
            raise TimeoutError("device psum")
        return out[0]

    def ours_fired() -> bool:
        if accelerator.is_last_process:
            accelerator.set_trigger()
        return accelerator.check_trigger()

    client.wait_at_barrier("bench/flag", timeout_ms)  # counter 0 of the reused id: see backends/jax/control.py
    backend = accelerator._backend

    def raw_barrier_bounded() -> None:
        """The raw barrier through the backend's caller thread (the bound on an unanswered call)."""
        counter[0] += 1
        key = f"bench/raw #{counter[0]}"
        backend._answered(lambda: client.wait_at_barrier(key, timeout_ms), key, RAW_TIMEOUT_S)

    from backends.jax.control import _Caller

    elsewhere = _Caller()
    elsewhere._core.thread_id = None  # a caller thread left wherever the scheduler puts it (before 2026-12-02)

    def raw_barrier_bounded_elsewhere() -> None:
        counter[0] += 1
        key = f"bench/raw #{counter[0]}"
        elsewhere.call(lambda: client.wait_at_barrier(key, timeout_ms), RAW_TIMEOUT_S)

    return {
        "wait_for_everyone": {"ours": accelerator.wait_for_everyone, "raw": raw_barrier,
                              "info: raw barrier through the caller thread": raw_barrier_bounded,
                              "info: the same, caller thread not kept on the caller's core":
                                  raw_barrier_bounded_elsewhere},
        "check_trigger": {"ours": accelerator.check_trigger, "raw": raw_barrier,
                          "info: raw barrier + key_value_dir_get (the two-trip protocol)": raw_barrier_dir_get,
                          "info: raw device psum (jit)": raw_psum,
                          "info: device psum on a thread with a deadline": psum_with_deadline,
                          "info: key_value_increment + blocking get": increment_then_get,
                          "info: flag barrier, flag set (raw)": flag_barrier_fired,
                          "info: ours, trigger set on the last process": ours_fired},
    }


def worker(args: argparse.Namespace) -> None:
    from unified import Accelerator

    accelerator = Accelerator()
    build = {"torch": _torch_pairs, "jax": _jax_pairs}[accelerator.backend]
    rows = [{"operation": operation, "stats": _measure(pairs, args.iters, args.block, args.warmup,
                                                       accelerator.wait_for_everyone)}
            for operation, pairs in build(accelerator).items()]
    if accelerator.is_main_process:
        emit({"backend": accelerator.backend, "num_processes": accelerator.num_processes,
              "iters": args.iters, "block": args.block, "rows": rows})
    accelerator.end_training()


# -- parent: launch one group per backend and print the table ----------------------------------
def table(results: List[dict]) -> str:
    rows = []
    for result in results:
        for row in result["rows"]:
            stats = row["stats"]
            ours = stats["ours"]["median_us"]
            for name, s in stats.items():
                if name == "ours":
                    continue
                label = row["operation"] if name == "raw" else f"{row['operation']} ({name})"
                rows.append([result["backend"], label, f"{ours:.1f}", f"{s['median_us']:.1f}",
                             f"{ours / s['median_us']:.2f}x"])
    return markdown_table(["backend", "operation", "ours median (µs)", "raw median (µs)", "ratio"], "llrrr", rows)


def show(results: List[dict], picture: bool) -> None:
    """The table; docs/benchmarks/img/collectives.png: per backend and operation, ours, the raw
    primitive and the "info" variants; one sample per block of calls (its median: a single call's
    min-max would only show the machine's hiccups)."""
    print(table(results))
    if picture and results:
        samples = {f"{r['backend']} {row['operation']}": {name: s["block_medians_us"]
                                                          for name, s in row["stats"].items()}
                   for r in results for row in r["rows"]}
        plot.draw(plot.image("collectives"), f"per-call latency, {results[0]['num_processes']} processes",
                  "µs per call", samples, note=f"a run = the median of a block of {results[0]['block']} calls")


def main(argv: Optional[List[str]] = None) -> int:
    return main_launched(__doc__, argv, __file__, worker, {"iters": (2000, "timed calls per variant"),
                                                           "block": (50, "calls per interleaved block"),
                                                           "warmup": (100, "untimed calls per variant first")}, 300.0,
                         lambda r: f"{r['num_processes']} processes, {r['iters']} calls per variant "
                                   f"(blocks of {r['block']})",
                         show)


if __name__ == "__main__":
    sys.exit(main())
