"""save_state / load_state to an S3-compatible object store, side by side in one run (issue 29).

Run from the repository root:

    python -m benchmarks.store_checkpoint [--size-gb 1.5] [--repeats 3] [--parts torch,jax] [--contenders a,b]

The parent starts moto's S3 server (``moto_server``, the server s3fs's own tests run against) in
a process of its own on 127.0.0.1, so that the server's work does not share the benchmark's
interpreter (`checkpointing.s3_server`), and makes one bucket. Each framework runs in a subprocess (``--part torch`` /
``--part jax``) that prints one JSON line; the parent prints the table (min, median, spread,
peak memory) that docs/benchmarks/checkpoint.md quotes.

Contenders, each writing the same state (the model and optimizer of benchmarks/checkpoint.py,
``size_gb`` in all) under its own prefix of the bucket, every round's prefix deleted after it:

* ``ours``: ``save_state("s3://…")`` (synchronous: committed and durable when it returns) and
  ``load_state``, which downloads each object once, straight into the live arrays, hashed as it
  streams (issue 48: one pass, no local copy);
* ``ours_verify_first``: ``load_state(url, verify_first=True)``: every object downloaded and
  verified first, into a private local copy, then the large arrays read from that copy into the
  live ones (the order before issue 48, kept as an option);
* ``ours_verify_first_two_downloads``: the same with ``UNIFIED_STORE_LOAD_COPY=0``: the large
  objects downloaded a second time instead of read from the local copy;
* ``ours_async``: ``save_state(url, async_save=True)`` (the blocking part) and
  ``wait_for_checkpoint()``;
* ``dcp_fsspec`` (torch): ``torch.distributed.checkpoint`` with its fsspec storage
  (``FsspecWriter`` / ``FsspecReader``; pickled ``.metadata``, ``torch.save`` shards), the state
  dicts of ``torch.distributed.checkpoint.state_dict``;
* ``raw`` (the limit): the live arrays' bytes uploaded with the same client (s3fs, one streamed
  multipart upload per object, 32 MiB parts, as ours) and downloaded into warm buffers of each
  object's size (allocated and touched in the warm-up round): nothing hashed, framed, verified
  or restored.

Accelerate's ``save_state("s3://…")`` writes into a local folder called ``s3:`` (issue 29), so
it is not a contender. Orbax: see the note the JAX part prints.

Every load is checked (a parameter and an optimizer moment changed after the save must come
back). One untimed warm-up round per contender, then ``--repeats`` rounds in rotated order; after
them, one more untimed round records each load's peak RSS beyond the live state
(`runner.PeakMemory`).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import warnings
from typing import Any, Callable, Dict, List

from benchmarks.checkpointing import (
    MEMORY_RSS,
    async_contender,
    bucket,
    contender,
    dcp_contender,
    jax_arrays,
    jax_leaves,
    jax_objects,
    jax_probe,
    path_rounds,
    raw_limit,
    s3_server,
    torch_arrays,
    torch_objects,
    torch_probe,
    torch_tensors,
)
from benchmarks.runner import GB, PartFailed, cells, emit, environment, log, module, print_command, run_part, table
from unified.runtime.environment import LOAD_COPY_VARIABLE

RAW_TARGET = {"save": 1.3, "load": 1.15}  # ours within this of the raw transfer (issue 29; the load: issue 48)
NAMES = ("save", "load")


def _with_variable(run: Callable[..., Dict[str, Any]], name: str, value: str) -> Callable[..., Dict[str, Any]]:
    """``run`` with the environment variable ``name`` set to ``value`` (`LOAD_COPY_VARIABLE` 0: a
    load that verifies first downloads the large objects again instead of keeping them on local disk)."""
    def with_variable(url: str, memory: bool = False) -> Dict[str, Any]:
        with environment(**{name: value}):
            return run(url, memory)

    return with_variable


def _part(args: argparse.Namespace, framework: str, contenders: Dict[str, Callable[..., Any]], state_bytes: int,
          versions: Dict[str, str]) -> Dict[str, Any]:
    if args.contenders:  # ``ours`` and ``raw`` always run: the report compares them
        chosen = {"ours", "raw", *args.contenders.split(",")}
        contenders = {name: run for name, run in contenders.items() if name in chosen}
    result = path_rounds(contenders, f"{args.bucket}/{framework}", args.repeats, memory=True)
    return {**result, "framework": framework, "state_bytes": state_bytes, "versions": versions}


def torch_part(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    import unified

    model, optimizer, layers = torch_objects(args.size_gb, args.hidden)
    state_bytes = sum(t.numel() * t.element_size() for t in torch_tensors(model, optimizer))
    log(f"torch: {layers} x Linear({args.hidden}, {args.hidden}), state {state_bytes / GB:.3f} GB")
    ours = unified.Accelerator(backend="torch")
    ours.prepare(model, optimizer)
    probe = torch_probe(model, optimizer)
    run_ours = contender(ours.save_state, ours.load_state, probe, names=NAMES)
    verified_first = contender(ours.save_state, functools.partial(ours.load_state, verify_first=True), probe,
                               names=NAMES)
    contenders = {"ours": run_ours, "ours_verify_first": verified_first,
                  "ours_verify_first_two_downloads": _with_variable(verified_first, LOAD_COPY_VARIABLE, "0"),
                  "ours_async": async_contender(ours, blocking="save (blocking)", total="save"),
                  "dcp_fsspec": dcp_contender(model, optimizer, probe, storage="fsspec", names=NAMES),
                  "raw": raw_limit(lambda: torch_arrays(model, optimizer), names=NAMES)}
    with warnings.catch_warnings():  # DCP in one process says it assumes one process, every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return _part(args, "torch", contenders, state_bytes, {"torch": torch.__version__})


def jax_part(args: argparse.Namespace) -> Dict[str, Any]:
    import jax

    import unified

    model, optimizer, layers = jax_objects(args.size_gb, args.hidden)
    state_bytes = sum(int(leaf.nbytes) for leaf in jax_leaves(model) + jax_leaves(optimizer))
    log(f"jax: {layers} x nnx.Linear({args.hidden}, {args.hidden}), state {state_bytes / GB:.3f} GB")
    ours = unified.Accelerator(backend="jax")
    model, optimizer = ours.prepare(model, optimizer)
    contenders = {"ours": contender(ours.save_state, ours.load_state, jax_probe(model, optimizer), names=NAMES),
                  "ours_async": async_contender(ours, blocking="save (blocking)", total="save"),
                  "raw": raw_limit(lambda: jax_arrays(model, optimizer), names=NAMES)}  # JAX reads nothing in place:
    return _part(args, "jax", contenders, state_bytes, {"jax": jax.__version__})  # ours is one pass


def report(results: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Object store: moto_server on 127.0.0.1 (its own process), s3fs; {args.repeats} rounds, seconds.", ""]
    for res in results:
        samples, memory, rows = res["samples"], res["memory"], []
        for op in ("save", "save (blocking)", "load"):
            raw = statistics.median(samples["raw"].get(op, samples["raw"]["save"]))
            for name, by_op in samples.items():
                if op in by_op:
                    peak = memory.get(name, {}).get(f"load {MEMORY_RSS}") if op == "load" else None
                    rows.append([name, op, *cells(by_op[op], "min median range ratio", raw, digits=2, ratio_digits=2),
                                 f"{peak / 2**20:.0f} MB" if peak is not None else ""])
        header = ["contender", "operation", "min", "median", "spread", "vs raw", "load peak beyond the live state"]
        lines += [f"**{res['framework']}**, {res['state_bytes'] / GB:.2f} GB of state ({res['versions']})", "",
                  table(header, "llrrrrr", rows)]
        ours_save = statistics.median(samples["ours"]["save"]) / statistics.median(samples["raw"]["save"])
        ours_load = statistics.median(samples["ours"]["load"]) / statistics.median(samples["raw"]["load"])
        lines += ["", f"Goal: within {RAW_TARGET['save']}x the raw transfer for a save: {ours_save:.2f}x "
                      f"({'met' if ours_save <= RAW_TARGET['save'] else 'NOT met'}); within "
                      f"{RAW_TARGET['load']}x for a load, with no local copy: {ours_load:.2f}x "
                      f"({'met' if ours_load <= RAW_TARGET['load'] else 'NOT met'}).", ""]
        if "dcp_fsspec" in samples:
            for op in ("save", "load"):
                mine, theirs = (statistics.median(samples[n][op]) for n in ("ours", "dcp_fsspec"))
                lines.append(f"- {op}: ours {mine:.2f} s, DCP fsspec {theirs:.2f} s "
                             f"({'ahead' if mine < theirs else 'behind'}, {theirs / mine:.2f}x)")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--parts", default="torch,jax")
    parser.add_argument("--contenders", default="",
                        help="only these contenders besides ours and raw (comma-separated; default: all)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bucket", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        emit(torch_part(args) if args.part == "torch" else jax_part(args))
        return
    print_command()
    results = []
    with s3_server():
        for part in args.parts.split(","):
            try:
                results.append(run_part(module("store_checkpoint", "--part", part, "--bucket", bucket(f"bench-{part}"),
                                               "--size-gb", str(args.size_gb), "--repeats", str(args.repeats),
                                               "--hidden", str(args.hidden), "--contenders", args.contenders)))
            except PartFailed as failure:
                sys.exit(f"{part} part failed ({failure})")
    print(report(results, args))


if __name__ == "__main__":
    main()
