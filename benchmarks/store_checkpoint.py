"""save_state / load_state to an S3-compatible object store, side by side in one run (issue 29).

Run from the repository root:

    python benchmarks/store_checkpoint.py [--size-gb 1.5] [--repeats 3] [--parts torch,jax]

The parent starts moto's S3 server (``moto_server``, the server s3fs's own tests run against) in
a process of its own on 127.0.0.1, so that the server's work does not share the benchmark's
interpreter, and makes one bucket. Each framework runs in a subprocess (``--part torch`` /
``--part jax``) that prints one JSON line; the parent prints the table (min, median, spread,
peak memory) that docs/benchmarks/checkpoint.md quotes.

Contenders, each writing the same state (the model and optimizer of benchmarks/checkpoint.py,
``size_gb`` in all) under its own prefix of the bucket, every round's prefix deleted after it:

* ``ours``: ``save_state("s3://…")`` (synchronous: committed and durable when it returns) and
  ``load_state`` (every byte verified before anything is restored);
* ``ours``'s load downloads each object once, verifying it, into a private local copy, and reads
  the large arrays from that copy into the live ones (bounded memory);
* ``ours_two_downloads``: ``UNIFIED_STORE_LOAD_COPY=0``: the large objects are downloaded a second
  time instead of read from the local copy (bounded memory, no local disk; the only way before);
* ``ours_one_pass``: the same with ``UNIFIED_IN_PLACE_MIN_BYTES`` above every array: the load
  downloads each object once, into fresh memory (a second copy of the state at the peak);
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
(`memory.PeakMemory`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint as local  # noqa: E402  (benchmarks/checkpoint.py: the same objects and round trip)
from memory import PeakMemory  # noqa: E402
from unified.launch import free_port  # noqa: E402

GB = local.GB
_log = local._log
PART_BYTES = 32 << 20
RAW_TARGET = 1.3  # issue 29: ours within 1.3x the raw transfer


def _store() -> Any:
    import fsspec

    return fsspec.filesystem("s3")


def _delete(url: str) -> None:
    fs = _store()
    try:
        fs.rm(url, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache()


def _round_trip(save: Callable[[], Any], load: Callable[[], Any], mutate: Callable[[], None],
                check: Callable[[], None], memory: bool) -> Dict[str, float]:
    """Time the save, change the state, time the load, check it; in the memory round the load's
    peak RSS beyond the memory before it (the live state) instead."""
    out: Dict[str, float] = {}
    out["save"] = local._timed(save)
    mutate()
    if memory:
        with PeakMemory(trim=True, anonymous=False) as peak:
            load()
        out["load peak"] = float(peak.peak - peak.before)
    else:
        out["load"] = local._timed(load)
    check()
    return out


def _with_variable(run: Callable[[str, bool], Dict[str, float]], name: str, value: str
                   ) -> Callable[[str, bool], Dict[str, float]]:
    """``run`` with the environment variable ``name`` set to ``value``."""
    def with_variable(url: str, memory: bool) -> Dict[str, float]:
        os.environ[name] = value
        try:
            return run(url, memory)
        finally:
            os.environ.pop(name)

    return with_variable


def _one_pass(run: Callable[[str, bool], Dict[str, float]]) -> Callable[[str, bool], Dict[str, float]]:
    """``run`` with every array of a load read in the verifying pass, into fresh memory."""
    return _with_variable(run, "UNIFIED_IN_PLACE_MIN_BYTES", str(1 << 62))


def _two_downloads(run: Callable[[str, bool], Dict[str, float]]) -> Callable[[str, bool], Dict[str, float]]:
    """``run`` with the large objects of a load downloaded again instead of kept on local disk."""
    return _with_variable(run, "UNIFIED_STORE_LOAD_COPY", "0")


def upload_raw(fs: Any, url: str, arrays: List[Any]) -> None:
    """The raw limit's upload: ``arrays``' bytes streamed to one object (multipart, `PART_BYTES`)."""
    with fs.open(url, "wb", block_size=PART_BYTES) as handle:
        for array in arrays:
            handle.write(memoryview(array).cast("B"))


def download_raw(fs: Any, url: str, buffer: bytearray) -> bytearray:
    """The raw limit's download: the object read into ``buffer`` (warm, reused when it has the
    object's size, else a new one), which is returned."""
    size = fs.size(url)
    if len(buffer) != size:
        buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    with fs.open(url, "rb", block_size=PART_BYTES, cache_type="none") as handle:
        while got < size:
            got += handle.readinto(view[got:got + PART_BYTES])
    return buffer


def _raw(files: Callable[[], Dict[str, List[Any]]]) -> Callable[[str, bool], Dict[str, float]]:
    """The limit: each object's arrays streamed to one object with the same client, then read
    back into warm buffers."""
    buffers: Dict[str, bytearray] = {}

    def run(url: str, memory: bool) -> Dict[str, float]:
        fs, views = _store(), files()

        def save() -> None:
            for name, arrays in views.items():
                upload_raw(fs, f"{url}/{name}", arrays)

        def load() -> None:
            for name in views:
                buffers[name] = download_raw(fs, f"{url}/{name}", buffers.get(name, bytearray()))

        return _round_trip(save, load, lambda: None, lambda: None, memory)

    return run


def _rounds(contenders: Dict[str, Callable[[str, bool], Dict[str, float]]], base: str, repeats: int) -> Dict[str, Any]:
    names = list(contenders)
    for name in names:
        _log(f"  warm-up {name}")
        contenders[name](f"{base}/warmup_{name}", False)
        _delete(f"{base}/warmup_{name}")
    samples: Dict[str, Dict[str, List[float]]] = {name: {} for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            url = f"{base}/{name}_{r}"
            times = contenders[name](url, False)
            _delete(url)
            for key, value in times.items():
                samples[name].setdefault(key, []).append(value)
            _log(f"  round {r} {name}: " + ", ".join(f"{k} {v:.2f}s" for k, v in times.items()))
    memory = {}
    for name in names:
        url = f"{base}/memory_{name}"
        memory[name] = contenders[name](url, True).get("load peak")
        _delete(url)
    return {"samples": samples, "memory": memory}


# -- torch --------------------------------------------------------------------------------------------
def torch_part(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import unified

    model, optimizer, layers = local._torch_objects(args)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    _log(f"torch: {layers} x Linear({args.hidden}, {args.hidden}), state {state_bytes / GB:.3f} GB")
    ours = unified.Accelerator(backend="torch")
    ours.prepare(model, optimizer)
    first = next(model.parameters())
    reference, moment = first.detach().clone(), optimizer.state[first]["exp_avg"].detach().clone()

    def mutate() -> None:
        with torch.no_grad():
            first.add_(1.0)
            optimizer.state[first]["exp_avg"].add_(1.0)

    def check() -> None:
        p = next(model.parameters())
        assert torch.equal(p.detach(), reference), "the load did not restore the parameters"
        assert torch.equal(optimizer.state[p]["exp_avg"], moment), "the load did not restore the optimizer"

    def run_ours(url: str, memory: bool) -> Dict[str, float]:
        return _round_trip(lambda: ours.save_state(url), lambda: ours.load_state(url), mutate, check, memory)

    def run_async(url: str, memory: bool) -> Dict[str, float]:
        blocking = local._timed(lambda: ours.save_state(url, async_save=True))
        return {"save (blocking)": blocking, "save": blocking + local._timed(ours.wait_for_checkpoint)}

    def run_dcp(url: str, memory: bool) -> Dict[str, float]:
        def save() -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=FsspecWriter(url))

        def load() -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            dcp.load(state, storage_reader=FsspecReader(url))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

        return _round_trip(save, load, mutate, check, memory)

    def live() -> Dict[str, List[Any]]:
        return {"model": [p.detach().numpy() for p in model.parameters()],
                "optimizer": [t.detach().numpy() for s in optimizer.state.values() for t in s.values()
                              if torch.is_tensor(t) and t.dim() > 0]}

    with warnings.catch_warnings():  # DCP in one process says it assumes one process, every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        result = _rounds({"ours": run_ours, "ours_two_downloads": _two_downloads(run_ours),
                          "ours_one_pass": _one_pass(run_ours), "ours_async": run_async,
                          "dcp_fsspec": run_dcp, "raw": _raw(live)},
                         f"{args.bucket}/torch", args.repeats)
    return {**result, "framework": "torch", "state_bytes": state_bytes,
            "versions": {"torch": torch.__version__}}


# -- jax ------------------------------------------------------------------------------------------------
def jax_part(args: argparse.Namespace) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import unified

    layers = max(1, round(args.size_gb * GB / 3 / 4 / (args.hidden * args.hidden + args.hidden)))
    model = local.nnx_stack(args.hidden, layers)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    x = jnp.ones((4, args.hidden), jnp.float32)
    optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
    leaves = jax.tree_util.tree_leaves(nnx.state(model)) + jax.tree_util.tree_leaves(nnx.state(optimizer))
    state_bytes = sum(int(leaf.nbytes) for leaf in leaves)
    _log(f"jax: {layers} x nnx.Linear({args.hidden}, {args.hidden}), state {state_bytes / GB:.3f} GB")
    ours = unified.Accelerator(backend="jax")
    model, optimizer = ours.prepare(model, optimizer)
    reference = np.array(model.layers[0].kernel[...])

    def mutate() -> None:
        model.layers[0].kernel[...] = model.layers[0].kernel[...] + 1.0

    def check() -> None:
        assert np.array_equal(np.asarray(model.layers[0].kernel[...]), reference), "the load did not restore the parameters"

    def run_ours(url: str, memory: bool) -> Dict[str, float]:
        return _round_trip(lambda: ours.save_state(url), lambda: ours.load_state(url), mutate, check, memory)

    def run_async(url: str, memory: bool) -> Dict[str, float]:
        blocking = local._timed(lambda: ours.save_state(url, async_save=True))
        return {"save (blocking)": blocking, "save": blocking + local._timed(ours.wait_for_checkpoint)}

    def live() -> Dict[str, List[Any]]:
        return {name: [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(nnx.state(obj)) if leaf.ndim > 0]
                for name, obj in (("model", model), ("optimizer", optimizer))}

    result = _rounds({"ours": run_ours, "ours_async": run_async, "raw": _raw(live)},  # JAX reads nothing in place:
                     f"{args.bucket}/jax", args.repeats)                              # ours is one pass
    return {**result, "framework": "jax", "state_bytes": state_bytes, "versions": {"jax": jax.__version__}}


# -- parent -----------------------------------------------------------------------------------------------
def _start_server() -> "tuple[subprocess.Popen, str]":
    port = free_port()
    server = subprocess.Popen([shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, endpoint
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("moto_server did not start within 30 s")


def _row(name: str, values: List[float], raw: float) -> str:
    return (f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | {max(values) - min(values):.2f} | "
            f"{statistics.median(values) / raw:.2f}x |")


def report(results: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Object store: moto_server on 127.0.0.1 (its own process), s3fs; {args.repeats} rounds, seconds.", ""]
    for res in results:
        samples, memory = res["samples"], res["memory"]
        lines += [f"**{res['framework']}**, {res['state_bytes'] / GB:.2f} GB of state ({res['versions']})", "",
                  "| contender | operation | min | median | spread | vs raw | load peak beyond the live state |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for op in ("save", "save (blocking)", "load"):
            raw = statistics.median(samples["raw"].get(op, samples["raw"]["save"]))
            for name, by_op in samples.items():
                if op in by_op:
                    peak = memory.get(name) if op == "load" else None
                    cells = _row(name, by_op[op], raw).split("|")[1:-1]
                    lines.append("| " + " | ".join([cells[0].strip(), op] + [c.strip() for c in cells[1:]]
                                                   + [f"{peak / 2**20:.0f} MB" if peak is not None else ""]) + " |")
        ours_save = statistics.median(samples["ours"]["save"]) / statistics.median(samples["raw"]["save"])
        ours_load = statistics.median(samples["ours"]["load"]) / statistics.median(samples["raw"]["load"])
        lines += ["", f"Goal: within {RAW_TARGET}x the raw transfer: save {ours_save:.2f}x "
                      f"({'met' if ours_save <= RAW_TARGET else 'NOT met'}), load {ours_load:.2f}x "
                      f"({'met' if ours_load <= RAW_TARGET else 'NOT met'}).", ""]
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
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bucket", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        print(json.dumps(torch_part(args) if args.part == "torch" else jax_part(args)))
        return
    server, endpoint = _start_server()
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        results = []
        for part in args.parts.split(","):
            bucket = f"bench-{part}-{int(time.time())}"
            subprocess.run([sys.executable, "-c", f"import boto3; boto3.client('s3').create_bucket(Bucket='{bucket}')"],
                           env=env, check=True)
            cmd = [sys.executable, __file__, "--part", part, "--bucket", f"s3://{bucket}", "--size-gb", str(args.size_gb),
                   "--repeats", str(args.repeats), "--hidden", str(args.hidden)]
            out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()
    print(report(results, args))


if __name__ == "__main__":
    main()
