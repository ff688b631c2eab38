"""save_state / load_state speed against Hugging Face Accelerate (torch) and plain Orbax (JAX).

Run from the repository root:

    python benchmarks/checkpoint.py [--size-gb 1.5] [--repeats 3] [--dir DIR] [--parts torch,jax]
                                    [--hidden 2048] [--profile-passes 2] [--load-rounds 0] [--no-picture]

Each framework runs in its own subprocess (``--part torch`` / ``--part jax``) that prints one
JSON line; the parent prints a markdown table, bytes on disk, throughput and a phase profile,
and draws the timed rounds in docs/benchmarks/img/checkpoint.png (save and load of every
contender), checkpoint-loads.png and checkpoint-resume.png (the load comparisons, when run);
``--no-picture``: no pictures.

What is measured (single process, CPU, page cache warm; it cannot be dropped without root):

* torch: a stack of ``nn.Linear(H, H)`` holding ``size_gb / 3`` GB of float32 parameters and
  ``torch.optim.AdamW`` after one real step (``exp_avg`` / ``exp_avg_sq`` exist), so the state
  is about ``size_gb``. The same model and optimizer are prepared by ``unified.Accelerator(
  backend="torch")`` and by ``accelerate.Accelerator(cpu=True)``; each writes into its own
  directory. Timed: ``save_state(dir)``, ``load_state(dir)``, and ours with
  ``async_save=True`` (the call's blocking time, then ``wait_for_checkpoint()``).
* jax: a stack of ``nnx.Linear`` with the same parameter bytes plus ``nnx.Optimizer(model,
  optax.adamw(...), wrt=nnx.Param)`` after one update, prepared by ``unified.Accelerator(
  backend="jax")``. Baseline: ``orbax.checkpoint.StandardCheckpointer`` saving
  ``{"model": nnx.state(model), "optimizer": nnx.state(optimizer)}`` then
  ``wait_until_finished()``; restore with the abstract (shape/dtype) tree as target, then
  ``nnx.update`` of both objects (the work our ``load_state`` does in place). That default
  compresses every chunk with zstd (level 3), so for information the same is also timed with
  ``AsyncCheckpointer(PyTreeCheckpointHandler(use_compression=False))`` (same bytes as ours).

Also in the same rounds, side by side (one table per framework): torch DCP
(``torch.distributed.checkpoint.save`` / ``load`` in one process, its default FileSystemWriter,
with the state dicts of ``torch.distributed.checkpoint.state_dict``) and the physical limit: the
same bytes written with one ``write`` per array from the live memory into one file per object,
and read back with ``readinto`` into warm memory of each file's size (nothing verified or
restored). After the timed rounds, one more untimed round per contender records the peak memory
of its save and load beyond what the process held before the call (benchmarks/memory.py): RSS,
kernel-exact (``VmHWM`` after ``clear_refs``), and anonymous memory alone (``RssAnon``, sampled
every 2 ms: apart from mapped file pages), each call after the C heap handed its free memory back
to the kernel (else a call reuses, unseen, what the previous one freed; not in the timed rounds,
since fresh pages cost time).

Fairness: one untimed warm-up round of every contender first; in each repeat the contenders
run in a rotated order; each contender's save is followed by its load, then its directory is
deleted and ``os.sync()`` is called (outside the timings) so that no contender pays for
another's dirty pages. Every load is checked: a parameter is changed after the save and must
come back. Medians over ``--repeats``.

Profile: after the timed rounds, ``--profile-passes`` more saves and loads of ours run phase by
phase through the internals of ``unified.checkpoint.manager`` (snapshot, per-file
``safetensors_io.write``, manifest + commit; read_manifest, per-file ``safetensors_io.read``,
``codec.decode``, ``set_state`` per object, RNG restore); the minimum of every phase is reported. The xxh3 share of the write is
measured by hashing the same in-memory buffers.

Load comparison (``--load-rounds N``, ``--resume-rounds N``; with ``--repeats 0
--profile-passes 0`` only they run): ours
saves once, then N interleaved rounds (rotated order) time three loads of the same checkpoint:
the raw read limit (one ``readinto`` per file into warm memory of its size, nothing verified or
restored), our ``load_state``, and our ``load_state`` with the reader it had before issue 11
finding 4 (files mapped and hashed over the mapping; torch optimizer moments copied into the
existing tensors), kept in this script only as that reference. Min, median, max and spread.
``--resume-rounds`` times the same loads each in a fresh process that has just built its objects
(torch: AdamW before its first step, so without moments), as a resuming script does, and on
torch Accelerate's ``load_state`` too: the one load a run really does, where the memory the load
fills is fresh for every contender but the raw limit (whose buffers are touched before the
timing), and where no contender reuses memory another one just freed (in one process, the
allocator hands memory freed by one contender's load to the next one's).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import plot  # noqa: E402  (benchmarks/ is not a package)
from mdtable import spread, table  # noqa: E402
from memory import PeakMemory  # noqa: E402
MARKER = "UNIFIED_BENCH_JSON "
GB = 1e9

TARGETS = {  # from the issue: (operation, minimum speed-up of ours over the baseline)
    ("torch", "save_state"): 1.5,
    ("torch", "load_state"): 2.0,
    ("jax", "save_state"): 2.0,
    ("jax", "load_state"): 2.0,
}
ASYNC_TARGET = 0.10  # async blocking time <= 10% of a synchronous save
# the peak memory keys `_round_trip` adds beside each operation's seconds (bytes)
MEMORY_RSS = "peak RSS beyond the live state"
MEMORY_ANON = "peak anonymous memory beyond the live state"


# -- helpers ---------------------------------------------------------------------------------------
def _log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Memory:
    """While ``active`` (`_run_rounds`' memory round, after the timed rounds), `_round_trip`
    measures each call's peak memory instead of only its time."""

    active = False


def _round_trip(save: Callable[[], Any], load: Callable[[], Any], mutate: Callable[[], None],
                check: Callable[[], None]) -> Dict[str, float]:
    """Time a save, change the live state, time the load, and check that the load undid the change.

    In the memory round, each call also records its peak memory beyond what the process held
    before it (`PeakMemory`: RSS, kernel-exact, and anonymous memory alone, sampled every 2 ms),
    in bytes, after the C heap's free memory went back to the kernel: without that a contender
    reuses, unseen, memory another one's call freed. That hand-back makes the call's allocations
    take fresh pages, which costs time (a torch load of 1.5 GB: 2.2 s against 0.3 s measured
    side by side), so the memory round is not one of the timed rounds."""
    times: Dict[str, float] = {}
    for op, call in (("save_state", save), ("load_state", load)):
        if op == "load_state":
            mutate()
        if not _Memory.active:
            times[op] = _timed(call)
            continue
        with PeakMemory(trim=True) as memory:
            call()
        times[f"{op} {MEMORY_RSS}"] = float(memory.peak - memory.before)
        times[f"{op} {MEMORY_ANON}"] = float(memory.anon_peak - memory.anon_before)
    check()
    return times


def _raw_limit(files: Callable[[], Dict[str, List[Any]]]) -> Callable[[str], Dict[str, float]]:
    """The physical limit of a save and a load, as a contender: ``files()`` gives, per file, the
    live arrays' own memory (NumPy views, no copy). Save: one ``write`` per array into one file
    per object, each file fsynced, then the folder (no header, no checksum; durable, as a
    synchronous ``save_state`` is when it returns). Load: one ``readinto`` per 64 MiB into warm memory of each file's size (allocated and
    touched in the untimed warm-up round, then reused): the same bytes, nothing verified or restored."""
    buffers: Dict[str, bytearray] = {}

    def run(path: str) -> Dict[str, float]:
        views = files()

        def save() -> None:
            os.makedirs(path, exist_ok=True)
            for name, arrays in views.items():
                fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for array in arrays:
                        data, done = memoryview(array).cast("B"), 0
                        while done < len(data):
                            done += os.write(fd, data[done:])
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        def load() -> None:
            for name in views:
                file = os.path.join(path, name)
                size = os.path.getsize(file)
                if len(buffers.get(name, b"")) != size:
                    buffers[name] = bytearray(size)  # zero-filled: touched
                view, got = memoryview(buffers[name]), 0
                with open(file, "rb", buffering=0) as handle:
                    while got < size:
                        got += handle.readinto(view[got:got + (64 << 20)])

        return _round_trip(save, load, lambda: None, lambda: None)

    return run


def _async_round(accelerator: Any, path: str) -> Dict[str, float]:
    blocking = _timed(lambda: accelerator.save_state(path, async_save=True))
    wait = _timed(accelerator.wait_for_checkpoint)
    return {"async blocking": blocking, "async wait": wait, "async total": blocking + wait}


def _disk_bytes(path: str) -> Dict[str, int]:
    """Apparent size and allocated bytes of every file under ``path``."""
    apparent = allocated = files = 0
    for folder, _, names in os.walk(path):
        for name in names:
            st = os.lstat(os.path.join(folder, name))
            apparent += st.st_size
            allocated += st.st_blocks * 512
            files += 1
    return {"apparent": apparent, "allocated": allocated, "files": files}


def _clean(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(parent):  # temporaries / replaced directories of our atomic commit
        for entry in os.listdir(parent):
            if entry.startswith("." + os.path.basename(path)):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    os.sync()  # deleted files' dirty pages are dropped; flush anything else before the next timing
    _wait_for_writeback()


def _dirty_bytes() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("Dirty:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _wait_for_writeback(below: int = 64 << 20, limit_s: float = 60.0) -> None:
    """Wait until the kernel has written back the dirty pages (``Dirty:`` in /proc/meminfo below
    ``below``), so that no timed save pays for another's writeback; at most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while _dirty_bytes() >= below and time.monotonic() < deadline:
        time.sleep(0.05)


def _run_rounds(contenders: Dict[str, Callable[[str], Dict[str, float]]], base: str, repeats: int) -> Dict[str, Any]:
    """Warm up every contender once, then ``repeats`` rounds in rotated order."""
    names = list(contenders)
    for name in names:
        path = os.path.join(base, f"warmup_{name}")
        _log(f"  warm-up {name}")
        contenders[name](path)
        _clean(path)
    samples: Dict[str, Dict[str, List[float]]] = {name: {} for name in names}
    disk: Dict[str, Dict[str, int]] = {}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            path = os.path.join(base, f"{name}_{r}")
            times = contenders[name](path)
            disk[name] = _disk_bytes(path)
            _clean(path)
            for key, value in times.items():
                samples[name].setdefault(key, []).append(value)
            _log(f"  round {r} {name}: " + ", ".join(f"{k} {v:.3f}s" for k, v in times.items()))
    medians = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    memory: Dict[str, Dict[str, float]] = {}
    _Memory.active = True
    try:
        for name in names:
            path = os.path.join(base, f"memory_{name}")
            memory[name] = {k: v for k, v in contenders[name](path).items() if "peak" in k}
            _clean(path)
    finally:
        _Memory.active = False
    return {"median": medians, "samples": samples, "disk": disk, "memory": memory}


# -- profile of ours, phase by phase ---------------------------------------------------------------
def _profile(accelerator: Any, directory: str, mutate: Callable[[], None], check: Callable[[], None]) -> Dict[str, float]:
    import xxhash

    from unified.checkpoint import codec, safetensors_io
    from unified.checkpoint.manifest import read_manifest

    manager = accelerator._checkpoints
    backend = manager.backend
    phases: Dict[str, float] = {}

    def step(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        value = fn()
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return value

    # save, as CheckpointManager.save does it
    for entry in manager.entries:
        phases[f"save: [info] get_state {entry.name} (part of snapshot)"] = _timed(entry.get_state)
    t0 = time.perf_counter()
    token, tmp = step("save: begin (token, tmp dir)", lambda: manager.begin(directory))
    snap = step("save: snapshot (whole: get_state + encode + export)", lambda: manager.snapshot(0))
    os.makedirs(tmp, exist_ok=True)
    files = {}
    for name, arrays in snap.files.items():
        files[name] = step(f"save: safetensors_io.write {name}", lambda: safetensors_io.write(os.path.join(tmp, name), arrays))
    reports = [{"files": files, "structures": snap.structures}]
    step("save: manifest + rename + fsync dir (_commit)", lambda: manager._commit(directory, tmp, token, reports, 0))
    phases["save: total (sum of the above)"] = time.perf_counter() - t0
    raws = [raw for arrays in snap.files.values() for (_, _, raw) in arrays.values()]
    phases["save: [info] xxh3 of the same bytes in memory"] = _timed(lambda: [xxhash.xxh3_64(memoryview(r)).digest() for r in raws])
    phases["save: [info] snapshot(detach=True) (async blocking part)"] = _timed(lambda: manager.snapshot(0, detach=True))
    del snap, raws

    # load, as CheckpointManager.load / _read do it
    mutate()
    t0 = time.perf_counter()
    manifest = step("load: read_manifest", lambda: read_manifest(directory))
    structures = manifest["structures"]
    decoded = {}
    names = [e.name for e in manager.entries] + [f"rng_{backend.process_index}"]
    for name in names:
        info = manifest["files"][f"{name}.safetensors"]
        path = os.path.join(directory, f"{name}.safetensors")

        arrays = step("load: safetensors_io.read (private memory, hashed as read, parsed)",
                      lambda: safetensors_io.read(path, info["size"], info["xxh3"]))
        convert = backend.from_numpy if not name.startswith("rng_") else (lambda a: a)
        decoded[name] = step(f"load: codec.decode {name}", lambda: codec.decode(structures[name], arrays, convert))
    for entry in manager.entries:
        step(f"load: set_state {entry.name}", lambda: entry.set_state(decoded[entry.name]))
    # as CheckpointManager._read gives it for the same process count (see resolve_rng otherwise)
    step("load: RNG restore", lambda: manager._restore_rng({**decoded[names[-1]], "derived": {}, "differing": []}, manifest))
    phases["load: total (sum of the above)"] = time.perf_counter() - t0
    check()
    del decoded, arrays
    mutate()
    phases["load: [info] accelerator.load_state end to end"] = _timed(lambda: accelerator.load_state(directory))
    check()
    _clean(directory)
    return phases


def _profiles(accelerator: Any, directory: str, mutate: Callable[[], None], check: Callable[[], None],
              passes: int) -> Dict[str, float]:
    """`_profile` ``passes`` times; the minimum of every phase (the least disturbed estimate)."""
    runs = [_profile(accelerator, directory, mutate, check) for _ in range(max(1, passes))]
    return {phase: min(run[phase] for run in runs) for phase in runs[0]}


# -- load: ours against the raw read limit and the reader before issue 11 (finding 4) ----------------
def _mapped_read(path: str, size: int, checksum: str) -> Dict[str, Any]:
    """The reader before issue 11 finding 4, kept here only to measure what private reads cost:
    map the file, hash the mapping, return read-only views of the file. Unsafe (a file changed
    after verification changes what is restored; a truncated one is SIGBUS)."""
    import mmap

    import xxhash

    from unified.checkpoint import safetensors_io

    fd = safetensors_io._open_for_reading(path)
    try:
        assert os.fstat(fd).st_size == size
        buffer = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    assert xxhash.xxh3_64_hexdigest(buffer) == checksum
    return safetensors_io.parse(buffer, path)


class _Patched:
    """Replace attributes for the duration of a ``with`` block."""

    def __init__(self, *changes: Any) -> None:
        self.changes = changes  # (object, attribute name, value)

    def __enter__(self) -> None:
        self.saved = [(obj, name, getattr(obj, name)) for obj, name, _ in self.changes]
        for obj, name, value in self.changes:
            setattr(obj, name, value)

    def __exit__(self, *exc: Any) -> None:
        for obj, name, value in self.saved:
            setattr(obj, name, value)


def _raw_reader(directory: str) -> Callable[[], None]:
    """The physical limit of a load: one ``readinto`` per file (64 MiB at a time) into warm
    memory of its size (allocated and touched once, before the timings): the same bytes, no
    checksum, no parsing, nothing restored."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    buffers = {n: bytearray(os.path.getsize(os.path.join(directory, n))) for n in names}

    def read() -> None:
        for name, buffer in buffers.items():
            view, got = memoryview(buffer), 0
            with open(os.path.join(directory, name), "rb", buffering=0) as handle:
                while got < len(view):
                    got += handle.readinto(view[got:got + (64 << 20)])

    read()
    return read


def _compare_loads(accelerator: Any, directory: str, mutate: Callable[[], None], check: Callable[[], None],
                   rounds: int, before: Callable[[], Any]) -> Dict[str, Any]:
    """Interleaved rounds (rotated order) of: the raw read limit, ours, and ours with the reader
    before issue 11 finding 4 (``before()`` is the context that patches it in). Every load but
    the raw one is checked (a changed parameter and optimizer moment must come back)."""
    import numpy as np

    from unified.checkpoint import safetensors_io

    accelerator.save_state(directory)
    raw = _raw_reader(directory)

    def ours() -> float:
        mutate()
        seconds = _timed(lambda: accelerator.load_state(directory))
        check()
        return seconds

    def mapped() -> float:
        with before(), _Patched((safetensors_io, "read", _mapped_read)):
            return ours()

    size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))

    def first_touch() -> float:
        """What memory new to the process costs: the checkpoint's size of it, from the kernel,
        written once per 4 KiB page (a load in a fresh process fills that much of it)."""
        import mmap

        start = time.perf_counter()
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        pages = np.frombuffer(memory, np.uint8)
        pages[::4096] = 1
        seconds = time.perf_counter() - start
        del pages
        memory.close()
        return seconds

    def first_touch_numpy() -> float:
        """The same through NumPy, as our reader allocates (NumPy asks for huge pages for arrays of
        4 MiB and more; glibc maps an allocation this large fresh from the kernel every time)."""
        start = time.perf_counter()
        pages = np.empty(size, np.uint8)
        pages[::4096] = 1
        seconds = time.perf_counter() - start
        del pages
        return seconds

    contenders = {"raw readinto (limit)": lambda: _timed(raw), "ours (private reads)": ours,
                  "before: mapped files": mapped, "[info] first touch of fresh memory": first_touch,
                  "[info] first touch of fresh NumPy memory": first_touch_numpy}
    for run in contenders.values():  # warm-up
        run()
    samples: Dict[str, List[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(contenders[name]())
        _log(f"  load round {r}: " + ", ".join(f"{n} {samples[n][-1]:.3f}s" for n in names))
    _clean(directory)
    return {"samples": samples, "bytes": size}


# -- torch ------------------------------------------------------------------------------------------
def _torch_objects(args: argparse.Namespace, step: bool = True) -> Any:
    """The torch model and AdamW optimizer of ``size_gb / 3`` GB of parameters, after one step
    (its moments exist) or before any (as a resuming script builds them)."""
    import torch

    torch.manual_seed(0)
    hidden = args.hidden
    layers = max(1, round(args.size_gb * GB / 3 / 4 / (hidden * hidden + hidden)))
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        model(torch.randn(4, hidden)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, layers


def _torch_before(ours: Any) -> "_Patched":
    """The torch restore before issue 11 finding 4: optimizer moments copied into the optimizer's
    existing tensors, other arrays copied, the model's copied by load_state_dict."""
    import numpy as np
    import torch

    from backends.torch import core
    from unified.tree import flatten

    backend = ours._backend

    def load_state_into(kind: str, obj: Any, state: Any) -> None:
        if kind == "optimizer":
            live = obj.state_dict().get("state", {})
            for index, values in state.get("state", {}).items():
                for key, value in list(values.items()):
                    tensor = live.get(index, {}).get(key)
                    if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == value.shape and tensor.dim():
                        tensor.copy_(core._tensor_from_numpy(value))
                        values[key] = tensor
        leaves, rebuild = flatten(state, lambda x: not isinstance(x, (dict, list, tuple)))
        tensors = [core._tensor_from_numpy(x if kind == "model" else np.array(x)) if isinstance(x, np.ndarray) else x
                   for x in leaves]
        (backend.unwrap_model(obj) if kind == "model" else obj).load_state_dict(rebuild(tensors))

    return _Patched((backend, "load_state_into", load_state_into))


def _resume(args: argparse.Namespace, ours: Any, before: Callable[[], Any], baseline: Any = None) -> Dict[str, float]:
    """``--save-to``: save ours (and the ``baseline`` Accelerator's, beside it) and stop.
    ``--resume-from``: one load in this fresh process, as a resuming script does it (objects just
    built), by ``--resume-as``: the raw read limit, ours, ours with the reader before issue 11
    finding 4, or the baseline."""
    from unified.checkpoint import safetensors_io

    if args.save_to:
        ours.save_state(args.save_to)
        if baseline is not None:
            baseline.save_state(args.save_to + ".baseline")
        return {}
    if args.resume_as == "baseline":
        return _measured(lambda: baseline.load_state(args.resume_from + ".baseline"))
    if args.resume_as == "raw readinto (limit)":
        read = _raw_reader(args.resume_from)  # its buffers are allocated and touched here, untimed
        return _measured(read)
    if args.resume_as in ("ours", "ours before issue 29 (fresh memory)"):  # the latter: UNIFIED_IN_PLACE_MIN_BYTES
        return _measured(lambda: ours.load_state(args.resume_from))
    with before(), _Patched((safetensors_io, "read", _mapped_read)):
        return _measured(lambda: ours.load_state(args.resume_from))


def _measured(fn: Callable[[], Any]) -> Dict[str, float]:
    """``fn``'s seconds, and its peak RSS beyond the live state: the peak during the call above
    the larger of the memory before and after it (`PeakMemory`'s kernel-exact ``VmHWM``, with no
    sampling thread beside the timed call), after a full garbage collection (untimed). "After"
    is read once the C heap handed its free memory back (`return_free_heap`): the arrays a JAX
    load replaced are freed but glibc keeps their memory, which would otherwise count as live
    state and hide the load's second copy."""
    from unified.libc import return_free_heap
    from memory import status_bytes

    if os.environ.get("UNIFIED_BENCH_GC_DEBT") != "1":
        # the script's own garbage (building the objects makes many Python objects) is collected
        # before the timing, as timeit does for the same reason: else a full collection (80-130 ms
        # for the JAX objects here) falls inside whichever load first allocates enough
        gc.collect()
    with PeakMemory(anonymous=False) as memory:
        seconds = _timed(fn)
    return_free_heap()
    return {"seconds": seconds, "peak": float(memory.peak - max(memory.before, status_bytes("VmRSS")))}


def torch_part(args: argparse.Namespace) -> Dict[str, Any]:
    import accelerate
    import torch

    import unified

    if args.save_to or args.resume_from:
        model, optimizer, _ = _torch_objects(args, step=bool(args.save_to))
        ours = unified.Accelerator(backend="torch")
        ours.prepare(model, optimizer)
        theirs = accelerate.Accelerator(cpu=True)
        theirs.prepare(model, optimizer)
        return _resume(args, ours, lambda: _torch_before(ours), theirs)
    hidden = args.hidden
    model, optimizer, layers = _torch_objects(args)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = param_bytes + sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    _log(f"torch: {layers} x Linear({hidden}, {hidden}), parameters {param_bytes / GB:.3f} GB, "
         f"model+optimizer state {state_bytes / GB:.3f} GB")

    ours = unified.Accelerator(backend="torch")
    ours_model, ours_opt = ours.prepare(model, optimizer)
    theirs = accelerate.Accelerator(cpu=True)
    their_model, their_opt = theirs.prepare(model, optimizer)
    first = next(model.parameters())
    reference = first.detach().clone()
    some_state = optimizer.state[first]["exp_avg"].detach().clone()

    def mutate() -> None:
        with torch.no_grad():
            first.add_(1.0)
            optimizer.state[first]["exp_avg"].add_(1.0)

    def check() -> None:
        p = next(model.parameters())  # load_state_dict copies into the same Parameter objects
        assert torch.equal(p.detach(), reference), "load_state did not restore the parameters"
        assert torch.equal(optimizer.state[p]["exp_avg"], some_state), "load_state did not restore the optimizer"

    def run_ours(path: str) -> Dict[str, float]:
        return _round_trip(lambda: ours.save_state(path), lambda: ours.load_state(path), mutate, check)

    def run_accelerate(path: str) -> Dict[str, float]:
        return _round_trip(lambda: theirs.save_state(path), lambda: theirs.load_state(path), mutate, check)

    def run_async(path: str) -> Dict[str, float]:
        return _async_round(ours, path)

    def run_dcp(path: str) -> Dict[str, float]:
        """torch.distributed.checkpoint, one process: its default FileSystemWriter / Reader
        (pickled .metadata, shards in torch.save format), the state dicts of
        torch.distributed.checkpoint.state_dict, as its tutorials do."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def save() -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)

        def load() -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

        return _round_trip(save, load, mutate, check)

    def live_files() -> Dict[str, List[Any]]:
        return {"model": [p.detach().numpy() for p in model.parameters()],
                "optimizer": [t.detach().numpy() for s in optimizer.state.values() for t in s.values()
                              if torch.is_tensor(t) and t.dim() > 0]}

    base = os.path.join(args.dir, "torch")
    os.makedirs(base, exist_ok=True)
    with warnings.catch_warnings():  # DCP in one process says it assumes one process, every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        result = _run_rounds({"ours": run_ours, "accelerate": run_accelerate, "ours_async": run_async,
                              "dcp": run_dcp, "raw": _raw_limit(live_files)}, base, args.repeats) if args.repeats else {}
    if args.load_rounds:
        _log("  load comparison")
        result["loads"] = _compare_loads(ours, os.path.join(base, "loads"), mutate, check, args.load_rounds,
                                         lambda: _torch_before(ours))
    _log("  profile")
    result["profile"] = _profiles(ours, os.path.join(base, "profile"), mutate, check, args.profile_passes) \
        if args.profile_passes else {}
    result.update(framework="torch", state_bytes=state_bytes, layers=layers, hidden=hidden,
                  versions={"torch": torch.__version__, "accelerate": accelerate.__version__})
    return result


# -- jax --------------------------------------------------------------------------------------------
def nnx_stack(hidden: int, layers: int) -> Any:
    """``layers`` x ``nnx.Linear(hidden, hidden)`` applied in turn, seeded with 0 (the JAX model of
    this script and of sharded_checkpoint.py)."""
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([nnx.Linear(hidden, hidden, rngs=rngs) for _ in range(layers)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Stack(nnx.Rngs(0))


def jax_part(args: argparse.Namespace) -> Dict[str, Any]:
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    import unified

    hidden = args.hidden
    layers = max(1, round(args.size_gb * GB / 3 / 4 / (hidden * hidden + hidden)))
    resuming = bool(args.save_to or args.resume_from)

    model = nnx_stack(hidden, layers)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    if resuming:  # the JAX restore itself did not change: only the reader differs
        ours = unified.Accelerator(backend="jax")
        ours.prepare(model, optimizer)
        return _resume(args, ours, _Patched)
    x = jnp.ones((4, hidden), jnp.float32)
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    del grads
    leaves = jax.tree_util.tree_leaves(nnx.state(model)) + jax.tree_util.tree_leaves(nnx.state(optimizer))
    state_bytes = sum(int(l.nbytes) for l in leaves)
    param_bytes = sum(int(l.nbytes) for l in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    _log(f"jax: {layers} x nnx.Linear({hidden}, {hidden}), parameters {param_bytes / GB:.3f} GB, "
         f"model+optimizer state {state_bytes / GB:.3f} GB (jax {jax.__version__}, devices {jax.devices()})")

    ours = unified.Accelerator(backend="jax")
    model, optimizer = ours.prepare(model, optimizer)
    reference = np.array(model.layers[0].kernel[...])
    big = [i for i, l in enumerate(jax.tree_util.tree_leaves(nnx.state(optimizer))) if l.ndim == 2][0]
    ref_mu = np.array(jax.tree_util.tree_leaves(nnx.state(optimizer))[big])

    def mutate() -> None:
        layer = model.layers[0]
        layer.kernel[...] = layer.kernel[...] + 1.0
        opt_state = nnx.state(optimizer)
        flat = jax.tree_util.tree_leaves(opt_state)
        nnx.update(optimizer, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(opt_state),
                                                           [l + 1 if i == big else l for i, l in enumerate(flat)]))

    def check() -> None:
        assert np.array_equal(np.asarray(model.layers[0].kernel[...]), reference), "load did not restore parameters"
        assert np.array_equal(np.asarray(jax.tree_util.tree_leaves(nnx.state(optimizer))[big]), ref_mu), \
            "load did not restore the optimizer"

    checkpointer = ocp.StandardCheckpointer()  # its default storage compresses chunks (zstd level 3)
    uncompressed = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))

    def run_ours(path: str) -> Dict[str, float]:
        return _round_trip(lambda: ours.save_state(path), lambda: ours.load_state(path), mutate, check)

    def run_orbax(path: str) -> Dict[str, float]:
        def save() -> None:
            checkpointer.save(os.path.abspath(path), {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
            checkpointer.wait_until_finished()

        def load() -> None:
            target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
            abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
            restored = checkpointer.restore(os.path.abspath(path), abstract)
            nnx.update(model, restored["model"])
            nnx.update(optimizer, restored["optimizer"])

        return _round_trip(save, load, mutate, check)

    def run_orbax_uncompressed(path: str) -> Dict[str, float]:
        def save() -> None:
            uncompressed.save(os.path.abspath(path), {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
            uncompressed.wait_until_finished()

        def load() -> None:
            target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
            abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
            restored = uncompressed.restore(os.path.abspath(path), args=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))
            nnx.update(model, restored["model"])
            nnx.update(optimizer, restored["optimizer"])

        return _round_trip(save, load, mutate, check)

    def run_async(path: str) -> Dict[str, float]:
        return _async_round(ours, path)

    def live_files() -> Dict[str, List[Any]]:
        return {name: [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(nnx.state(obj)) if leaf.ndim > 0]
                for name, obj in (("model", model), ("optimizer", optimizer))}

    base = os.path.join(args.dir, "jax")
    os.makedirs(base, exist_ok=True)
    result = _run_rounds({"ours": run_ours, "orbax": run_orbax, "ours_async": run_async,
                          "orbax_uncompressed": run_orbax_uncompressed, "raw": _raw_limit(live_files)},
                         base, args.repeats) if args.repeats else {}
    if args.load_rounds:  # the JAX restore itself did not change: only the reader differs
        _log("  load comparison")
        result["loads"] = _compare_loads(ours, os.path.join(base, "loads"), mutate, check, args.load_rounds, _Patched)
    _log("  profile")
    result["profile"] = _profiles(ours, os.path.join(base, "profile"), mutate, check, args.profile_passes) \
        if args.profile_passes else {}
    checkpointer.close()
    uncompressed.close()
    result.update(framework="jax", state_bytes=state_bytes, layers=layers, hidden=hidden,
                  versions={"jax": jax.__version__, "flax": flax.__version__, "orbax-checkpoint": ocp.__version__})
    return result


# -- parent: run the parts, print the report ------------------------------------------------------------
def _speedup(ours: float, baseline: float) -> str:
    return f"{baseline / ours:.2f}x" if ours > 0 else "-"


def _load_table(results: List[Dict[str, Any]], key: str) -> List[str]:
    """A load comparison (`_compare_loads`: ``loads``; `_resume_rounds`: ``resume``): every
    contender's min / median / max and spread, and its median against the raw read limit's."""
    rows = []
    for res in results:
        loads = res.get(key)
        if not loads:
            continue
        limit = statistics.median(loads["samples"]["raw readinto (limit)"])
        peaks = loads.get("peaks", {})
        for name, values in loads["samples"].items():
            peak = f"{statistics.median(peaks[name]) / MB:,.0f} ({max(peaks[name]) / MB:,.0f})" if peaks.get(name) else "-"
            rows.append([f"{res['framework']} ({loads['bytes'] / GB:.2f} GB)", name, len(values),
                         *spread(values, limit, spread_digits=1, ratio_digits=2), peak])
        rows.append(["", "samples (s)", json.dumps({n: [round(x, 3) for x in v] for n, v in loads["samples"].items()}),
                     "", "", "", "", "", ""])
    header = ["framework", "load of", "rounds", "min (s)", "median (s)", "max (s)", "spread (max/min)", "median / limit",
              "peak RSS beyond the live state, median (max), MB"]
    return table(header, "llrrrrrrr", rows).splitlines() if rows else []


NAMES = {"ours": "ours", "accelerate": "Accelerate", "orbax": "Orbax (default: zstd)",
         "orbax_uncompressed": "Orbax, use_compression=False", "dcp": "torch DCP (FileSystemWriter)",
         "raw": "raw write / readinto (the limit)"}
MB = 1e6


def _side_by_side(res: Dict[str, Any]) -> List[str]:
    """Every synchronous contender of one framework in one table: save and load (median, min-max,
    median against the raw limit's) and the peak memory of each beyond the live state (the
    memory round)."""
    samples, memory = res["samples"], res.get("memory", {})
    names = [n for n in ("ours", "accelerate", "orbax", "orbax_uncompressed", "dcp", "raw") if n in samples]
    limit = {op: statistics.median(samples["raw"][op]) for op in ("save_state", "load_state")} if "raw" in samples else {}
    rows = []
    for name in names:
        row = [res["framework"], NAMES[name]]
        for op in ("save_state", "load_state"):
            values = samples[name][op]
            median = statistics.median(values)
            row += [f"{median:.3f}", f"{min(values):.3f}-{max(values):.3f}",
                    f"{median / limit[op]:.2f}x" if limit else "-"]
        for key in (MEMORY_RSS, MEMORY_ANON):
            row.append(" / ".join(f"{memory.get(name, {}).get(f'{op} {key}', 0) / MB:,.0f}" for op in ("save_state", "load_state")))
        rows.append(row)
    header = ["framework", "contender", "save median (s)", "save min-max", "save / limit", "load median (s)",
              "load min-max", "load / limit", "peak RSS beyond the live state, save / load (MB)",
              "peak anonymous memory beyond it, save / load (MB)"]
    return table(header, "llrrrrrrrr", rows).splitlines()


def picture(results: List[Dict[str, Any]]) -> None:
    """The timed rounds of every contender: checkpoint.png (save and load of ours, the peers and
    our async save's blocking part), checkpoint-loads.png and checkpoint-resume.png (the load
    comparisons with the raw read limit, when they ran)."""
    rounds: Dict[str, Dict[str, List[float]]] = {}
    for res in results:
        fw, samples = res["framework"], res.get("samples", {})
        for op in ("save_state", "load_state"):
            group = rounds.setdefault(f"{fw} {op} ({res['state_bytes'] / GB:.2f} GB)", {})
            for name, times in samples.items():
                if op in times:
                    group[NAMES.get(name, name)] = times[op]
            if op == "save_state" and "async blocking" in samples.get("ours_async", {}):
                group["ours, save_state(async_save=True): blocking part"] = samples["ours_async"]["async blocking"]
    if any(rounds.values()):
        plot.draw(plot.image("checkpoint"), "save_state / load_state: ours, Accelerate and torch DCP (torch), Orbax (JAX), the raw limit",
                  "seconds", rounds)
    for key, part, what in (("loads", "loads", "repeated in one process"),
                            ("resume", "resume", "each in a fresh process (a resume)")):
        loads = {f"{res['framework']} ({res[key]['bytes'] / GB:.2f} GB)": res[key]["samples"]
                 for res in results if res.get(key)}
        if loads:
            plot.draw(plot.image("checkpoint", part), f"load_state against the raw read limit, {what}", "seconds", loads)


def report(results: List[Dict[str, Any]]) -> str:
    lines = ["| framework | operation | ours (s) | baseline (s) | speed-up | target | met |",
             "|---|---|---:|---:|---:|---|---|"]
    extra = []
    for res in results:
        if "median" not in res:  # --repeats 0
            continue
        fw, med = res["framework"], res["median"]
        base_name = "accelerate" if fw == "torch" else "orbax"
        for op in ("save_state", "load_state"):
            ours, base = med["ours"][op], med[base_name][op]
            need = TARGETS[(fw, op)]
            lines.append(f"| {fw} | {op} (vs {base_name}) | {ours:.3f} | {base:.3f} | {_speedup(ours, base)} | "
                         f">= {need:g}x | {'yes' if base / ours >= need else 'NO'} |")
        if fw == "jax":
            for op in ("save_state", "load_state"):
                ours, base = med["ours"][op], med["orbax_uncompressed"][op]
                lines.append(f"| {fw} | {op} (info: vs orbax PyTreeCheckpointHandler(use_compression=False)) | "
                             f"{ours:.3f} | {base:.3f} | {_speedup(ours, base)} | | |")
        block, wait, sync = med["ours_async"]["async blocking"], med["ours_async"]["async wait"], med["ours"]["save_state"]
        share = block / sync
        lines.append(f"| {fw} | save_state(async_save=True) blocking (vs our sync save) | {block:.3f} | {sync:.3f} | "
                     f"{share:.1%} of sync | <= {ASYNC_TARGET:.0%} | {'yes' if share <= ASYNC_TARGET else 'NO'} |")
        lines.append(f"| {fw} | wait_for_checkpoint after it | {wait:.3f} | | | | |")
        gb = res["state_bytes"] / GB
        extra.append(f"\n{fw}: {res['layers']} x Linear({res['hidden']}, {res['hidden']}), state {gb:.3f} GB; "
                     f"versions {res['versions']}")
        extra.append("| contender | files | bytes on disk (apparent) | allocated | save GB/s (median) | load GB/s (median) "
                     "| save min (s) | load min (s) |")
        extra.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name in [n for n in ("ours", base_name, "orbax_uncompressed", "dcp", "raw") if n in res["disk"]]:
            d, s = res["disk"][name], res["samples"][name]
            extra.append(f"| {name} | {d['files']} | {d['apparent']:,} | {d['allocated']:,} | "
                         f"{gb / med[name]['save_state']:.2f} | {gb / med[name]['load_state']:.2f} | "
                         f"{min(s['save_state']):.3f} | {min(s['load_state']):.3f} |")
        extra.append("samples (s): " + json.dumps({n: {k: [round(x, 3) for x in v] for k, v in s.items()}
                                                   for n, s in res["samples"].items()}))
        extra.append(f"\n{fw}: every contender side by side (the limit: the same bytes written with one write per "
                     f"array, read with readinto into warm memory; peak memory: {PeakMemory.method} for RSS, RssAnon "
                     "sampled every 2 ms, in one more untimed round after the C heap handed its free memory back)")
        extra += _side_by_side(res)
    for res in results:
        if res.get("profile"):
            extra.append(f"\n{res['framework']}: profile of ours (phase by phase; minimum of each phase over the profile "
                         "passes, seconds)")
            extra.append("| phase | s |")
            extra.append("|---|---:|")
            for phase, seconds in res["profile"].items():
                extra.append(f"| {phase} | {seconds:.3f} |")
    loads = _load_table(results, "loads")
    if loads:
        extra += ["\nload_state against the raw read limit and the reader before issue 11 finding 4, repeated in "
                  "one process (interleaved rounds, rotated order)", *loads]
    resumes = _load_table(results, "resume")
    if resumes:
        extra += ["\nthe same, each load in a fresh process that has just built its objects, as a resuming "
                  "script does (interleaved rounds, rotated order)", *resumes]
    return "\n".join((lines if len(lines) > 2 else []) + extra)


def _run_part(cmd: List[str], part: str, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    found = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not found:
        sys.exit(f"{part} part failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return json.loads(found[-1][len(MARKER):])


def _resume_rounds(cmd: List[str], part: str, directory: str, rounds: int) -> Dict[str, Any]:
    """Save once, then ``rounds`` rounds (rotated order) of one process per contender that builds
    the objects and times one load (`_resume`)."""
    _run_part(cmd + ["--save-to", directory], part)
    names = ["raw readinto (limit)", "ours", "ours before issue 29 (fresh memory)", "before: mapped files"] + \
        (["baseline"] if part == "torch" else [])
    # the loads before issue 29 read every array into fresh memory (no array is large enough to place)
    fresh = {"UNIFIED_IN_PLACE_MIN_BYTES": str(1 << 62)}
    samples: Dict[str, List[float]] = {name: [] for name in names}
    peaks: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            got = _run_part(cmd + ["--resume-from", directory, "--resume-as", name], part,
                            fresh if "before" in name else None)
            samples[name].append(got["seconds"])
            peaks[name].append(got["peak"])
        _log(f"  resume round {r}: " + ", ".join(f"{n} {samples[n][-1]:.3f}s {peaks[n][-1] / MB:,.0f} MB" for n in names))
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    _clean(directory)
    _clean(directory + ".baseline")
    if "baseline" in samples:
        samples["accelerate (baseline)"] = samples.pop("baseline")
        peaks["accelerate (baseline)"] = peaks.pop("baseline")
    return {"samples": samples, "peaks": peaks, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.5, help="model + optimizer state per framework (GB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a new temporary directory)")
    parser.add_argument("--hidden", type=int, default=2048, help="width of each Linear layer")
    parser.add_argument("--parts", default="torch,jax")
    parser.add_argument("--profile-passes", type=int, default=2, help="phase profile passes (minimum per phase)")
    parser.add_argument("--load-rounds", type=int, default=0,
                        help="rounds of the load comparison: ours, the raw read limit, the mapped reader before")
    parser.add_argument("--resume-rounds", type=int, default=0,
                        help="rounds of the same comparison, each load in a fresh process (a resume)")
    parser.add_argument("--read-chunk-mib", type=int, default=None,
                        help="load_state's read chunk (MiB; unified's default 16), to measure the choice")
    parser.add_argument("--readers", type=int, default=None,
                        help="load_state's reader threads per file (unified's default: min(4, CPUs)), to measure the choice")
    parser.add_argument("--part", choices=["torch", "jax"], help=argparse.SUPPRESS)
    parser.add_argument("--save-to", help=argparse.SUPPRESS)
    parser.add_argument("--resume-from", help=argparse.SUPPRESS)
    parser.add_argument("--resume-as", help=argparse.SUPPRESS)
    plot.add_option(parser)
    args = parser.parse_args()

    if args.part:
        from unified.checkpoint import safetensors_io

        if args.read_chunk_mib:
            safetensors_io._READ_CHUNK = args.read_chunk_mib << 20
        if args.readers:
            safetensors_io._READERS = args.readers
        res = (torch_part if args.part == "torch" else jax_part)(args)
        print(MARKER + json.dumps(res), flush=True)
        return

    own_dir = args.dir is None
    directory = tempfile.mkdtemp(prefix="unified-ckpt-bench-") if own_dir else os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    results = []
    try:
        for part in [p for p in args.parts.split(",") if p]:
            _log(f"== {part} ==")
            cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--size-gb", str(args.size_gb),
                   "--repeats", str(args.repeats), "--dir", directory, "--hidden", str(args.hidden),
                   "--profile-passes", str(args.profile_passes), "--load-rounds", str(args.load_rounds)]
            cmd += [f"--{name}={value}" for name, value in (("read-chunk-mib", args.read_chunk_mib),
                                                             ("readers", args.readers)) if value]
            results.append(_run_part(cmd, part))
            if args.resume_rounds:
                _log(f"  loads in fresh processes ({part})")
                results[-1]["resume"] = _resume_rounds(cmd, part, os.path.join(directory, f"resume_{part}"),
                                                       args.resume_rounds)
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"--size-gb {args.size_gb} --repeats {args.repeats} --load-rounds {args.load_rounds} "
          f"--resume-rounds {args.resume_rounds} --hidden {args.hidden}; "
          f"wall time {time.perf_counter() - started:.0f} s; 1-min load average at start {load_start:.2f}, "
          f"at end {os.getloadavg()[0]:.2f} (other processes on this machine disturb the timings)\n")
    print(report(results))
    if not args.no_picture:
        picture(results)


if __name__ == "__main__":
    main()
