"""save_state / load_state speed against Hugging Face Accelerate (torch) and plain Orbax (JAX).

Run from the repository root:

    python -m benchmarks.checkpoint [--size-gb 1.5] [--repeats 3] [--dir DIR] [--parts torch,jax]
                                    [--hidden 2048] [--profile-passes 2] [--load-rounds 0]
                                    [--resume-rounds 0] [--no-picture]

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
of its save and load beyond what the process held before the call (`runner.PeakMemory`): RSS,
kernel-exact (``VmHWM`` after ``clear_refs``), and anonymous memory alone (``RssAnon``, sampled
every 2 ms: apart from mapped file pages), each call after the C heap handed its free memory back
to the kernel (else a call reuses, unseen, what the previous one freed; not in the timed rounds,
since fresh pages cost time).

Fairness (`runner.interleaved`): one untimed warm-up round of every contender first, Python's
garbage collected before every timing; in each repeat the contenders run in a rotated order;
each contender's save is followed by its load, then its directory is deleted and ``os.sync()``
is called (outside the timings) so that no contender pays for another's dirty pages. Every load
is checked: a parameter is changed after the save and must come back. Medians over
``--repeats``.

Profile: after the timed rounds, ``--profile-passes`` more saves and loads of ours run phase by
phase through the internals of ``unified.checkpoint.manager`` (snapshot, per-file
``safetensors_io.write``, manifest + commit; read_manifest, per-file ``safetensors_io.read``,
``codec.decode``, ``set_state`` per object, RNG restore); the minimum of every phase is
reported. The xxh3 share of the write is measured by hashing the same in-memory buffers.

Load comparison (``--load-rounds N``; with ``--repeats 0 --profile-passes 0`` only it and the
resume rounds run): ours saves once, then N interleaved rounds (rotated order) in one process
time: the raw read into warm memory (one ``readinto`` per file into buffers of its size touched
before the timings, nothing verified or restored), our ``load_state``, and our ``load_state``
with the reader it had before issue 11 finding 4 (files mapped and hashed over the mapping;
torch optimizer moments copied into the existing tensors), kept in this script only as that
reference. Min, median, max and spread.

Resume (``--resume-rounds N``, issue 48's measures): ours saves once (and each baseline beside
it, from the same state), then N interleaved rounds (rotated order) in which every contender
loads in a fresh process of its own that has just built and prepared its objects, as a
resuming script does (torch: AdamW before its first step, so without moments; JAX: a new
``nnx.Optimizer``), after a full garbage collection, with the peak RSS beyond the live state
(`runner.measured`); every load but the warm read is checked afterwards, untimed (the first
parameter and, but for the floor, its first moment must equal the checkpoint's). The contenders
(`RESUME`):

* raw floor (issue 48's "raw contender"): the model's file read with one ``pread`` per tensor
  straight into the live parameter of that name (torch: the tensors' memory; JAX: the arrays'
  XLA buffers, through ``unsafe_buffer_pointer``), the optimizer's file with ``pread`` into
  fresh memory of its size allocated in the call (in ordinary pages, as ours), one thread, nothing verified;
  and for information the same reads shared by 2 threads (ours reads with several);
* [info] the raw read into warm buffers (touched before the timing: no fresh process has them);
* ours (one pass, the default) and, for information, ours with ``load_state(verify_first=True)``;
* the baselines: torch Accelerate's ``load_state`` of its own checkpoint; JAX Orbax's
  ``StandardCheckpointer`` (zstd) and, for information, ``PyTreeCheckpointHandler(
  use_compression=False)``, each restoring with the abstract tree, then ``nnx.update``;
* the safetensors peers (``pip install '.[bench]'``; left out when not installed), reading
  ours' own model and optimizer files (plain safetensors) with their defaults: Run:ai Model
  Streamer (``SafetensorsStreamer().stream_files(paths, device="cpu")``, ``get_tensors()``) and
  fastsafetensors (``SafeTensorsFileLoader(None, "cpu", nogds=True)``, ``add_filenames``,
  ``copy_files_to_device()``, ``get_tensor``), into CPU torch tensors. torch: each parameter
  copied into the live one as it comes, the optimizer's tensors kept as read (fresh memory)
  and installed by ``optimizer.load_state_dict`` (live ``param_groups``). JAX: every tensor
  handed over with ``jax.dlpack.from_dlpack`` (no copy where XLA accepts the alignment), then
  ``nnx.update`` of both objects. Their imports (and torch's, on JAX) are made before the timing.

The report gives each contender's min / median / max / spread, its median against the raw floor
and against the warm read, its peak memory, and a table of issue 48's measures: ours <= 1.1x the
raw floor, >= 1.1x faster than Accelerate (torch) / Orbax's default (JAX), faster than the fastest
installed peer, peak beyond the live state <= 256 MB. ``--size-gb 0.5,1.5`` runs every part at
each size in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from benchmarks import plot
from benchmarks.checkpointing import (
    MEMORY_ANON,
    MEMORY_RSS,
    Phases,
    async_contender,
    clean,
    contender,
    dcp_contender,
    jax_arrays,
    jax_leaves,
    jax_objects,
    jax_probe,
    orbax_contenders,
    patched,
    path_rounds,
    raw_limit,
    read_files,
    stored_bytes,
    torch_arrays,
    torch_objects,
    torch_probe,
    torch_tensors,
)
from benchmarks.runner import (
    GB,
    MB,
    PartFailed,
    PeakMemory,
    Run,
    beyond,
    cells,
    clocked,
    emit,
    interleaved,
    log,
    measured,
    module,
    print_command,
    run_part,
    table,
    timed,
)

TARGETS = {  # from the issue: (operation, minimum speed-up of ours over the baseline)
    ("torch", "save_state"): 1.5,
    ("torch", "load_state"): 2.0,
    ("jax", "save_state"): 2.0,
    ("jax", "load_state"): 2.0,
}
ASYNC_TARGET = 0.10  # async blocking time <= 10% of a synchronous save
NAMES = {"ours": "ours", "accelerate": "Accelerate", "orbax": "Orbax (default: zstd)",
         "orbax_uncompressed": "Orbax, use_compression=False", "dcp": "torch DCP (FileSystemWriter)",
         "raw": "raw write / readinto (the limit)"}


# -- the timed rounds, the profile and the load comparisons (in a part's process) ---------------------
def _profile(accelerator: Any, directory: str, probe: Any) -> Dict[str, float]:
    """One save and one load of ours as ``CheckpointManager.save`` / ``load`` do them, phase by phase."""
    import xxhash

    from unified.checkpoint import codec, safetensors_io
    from unified.checkpoint.manifest import read_manifest

    manager = accelerator._checkpoints
    backend = manager.backend
    phases = Phases()
    step, seconds = phases.run, phases.seconds
    for entry in manager.entries:
        seconds[f"save: [info] get_state {entry.name} (part of snapshot)"] = timed(entry.get_state)

    def save() -> Any:
        token, tmp = step("save: begin (token, tmp dir)", manager.begin, directory)
        snap = step("save: snapshot (whole: get_state + encode + export)", manager.snapshot, 0)
        os.makedirs(tmp, exist_ok=True)
        files = {name: step(f"save: safetensors_io.write {name}", safetensors_io.write, os.path.join(tmp, name), arrays)
                 for name, arrays in snap.files.items()}
        step("save: manifest + rename + fsync dir (_commit)", manager._commit, directory, tmp, token,
             [{"files": files, "structures": snap.structures}], snap)
        return snap

    snap, seconds["save: total (sum of the above)"] = clocked(save)
    raws = [raw for arrays in snap.files.values() for (_, _, raw) in arrays.values()]
    seconds["save: [info] xxh3 of the same bytes in memory"] = timed(lambda: [xxhash.xxh3_64(memoryview(r)).digest()
                                                                               for r in raws])
    seconds["save: [info] snapshot(detach=True) (async blocking part)"] = timed(
        lambda: manager.snapshot(0, detach=True))
    del snap
    raws.clear()
    names = [e.name for e in manager.entries] + [f"rng_{backend.process_index}"]

    def load() -> None:
        manifest = step("load: read_manifest", read_manifest, directory)
        decoded = {}
        for name in names:
            info = manifest["files"][f"{name}.safetensors"]
            arrays = step("load: safetensors_io.read (private memory, hashed as read, parsed)", safetensors_io.read,
                          os.path.join(directory, f"{name}.safetensors"), info["size"], info["xxh3"])
            convert = backend.from_numpy if not name.startswith("rng_") else (lambda a: a)
            decoded[name] = step(f"load: codec.decode {name}", codec.decode, manifest["structures"][name], arrays,
                                 convert)
        for entry in manager.entries:
            step(f"load: set_state {entry.name}", entry.set_state, decoded[entry.name])
        # as CheckpointManager._read gives it for the same process count (see resolve_rng otherwise)
        step("load: RNG restore", manager._restore_rng, {**decoded[names[-1]], "derived": {}, "differing": []},
             manifest)

    probe.mutate()
    _, seconds["load: total (sum of the above)"] = clocked(load)
    probe.check()
    probe.mutate()
    seconds["load: [info] accelerator.load_state end to end"] = timed(lambda: accelerator.load_state(directory))
    probe.check()
    clean(directory)
    return seconds


def _mapped_read(path: str, size: int, checksum: str) -> Dict[str, Any]:
    """The reader before issue 11 finding 4, kept here only to measure what private reads cost:
    map the file, hash the mapping, return read-only views of the file. Unsafe (a file changed
    after verification changes what is restored; a truncated one is SIGBUS)."""
    import mmap

    import xxhash

    from unified.checkpoint import safetensors_io
    from unified.checkpoint.safetensors_format import _open_for_reading

    fd = _open_for_reading(path)
    try:
        assert os.fstat(fd).st_size == size
        buffer = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    assert xxhash.xxh3_64_hexdigest(buffer) == checksum
    return safetensors_io.parse(buffer, path)


def _raw_reader(directory: str) -> Callable[[], None]:
    """The physical limit of a load (`read_files`: one ``readinto`` per 64 MiB of each file into
    warm memory of its size, allocated and touched here, before the timings)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    buffers: Dict[str, bytearray] = {}
    read_files(directory, buffers, names)
    return lambda: read_files(directory, buffers, names)


def _compare_loads(accelerator: Any, directory: str, probe: Any, rounds: int, before: Callable[[], Any]
                   ) -> Dict[str, Any]:
    """Interleaved rounds (rotated order) of: the raw read limit, ours, and ours with the reader
    before issue 11 finding 4 (``before()`` is the context that patches it in). Every load but
    the raw one is checked (a changed parameter and optimizer moment must come back)."""
    import mmap

    import numpy as np

    from unified.checkpoint import safetensors_io

    accelerator.save_state(directory)
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))

    def ours() -> float:
        probe.mutate()
        seconds = timed(lambda: accelerator.load_state(directory))
        probe.check()
        return seconds

    def mapped() -> float:
        with before(), patched((safetensors_io, "read", _mapped_read)):
            return ours()

    def touched(pages: Any) -> Any:
        pages[::4096] = 1
        return pages

    def first_touch() -> float:
        """What memory new to the process costs: the checkpoint's size of it, from the kernel,
        written once per 4 KiB page (a load in a fresh process fills that much of it)."""
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        pages, seconds = clocked(touched, np.frombuffer(memory, np.uint8))
        del pages
        memory.close()
        return seconds

    def first_touch_numpy() -> float:
        """The same through NumPy, as our reader allocates (NumPy asks for huge pages for arrays of
        4 MiB and more; glibc maps an allocation this large fresh from the kernel every time)."""
        pages, seconds = clocked(lambda: touched(np.empty(size, np.uint8)))
        del pages
        return seconds

    samples = interleaved({"raw readinto (limit)": _raw_reader(directory), "ours (private reads)": ours,
                           "before: mapped files": mapped, "[info] first touch of fresh memory": first_touch,
                           "[info] first touch of fresh NumPy memory": first_touch_numpy}, rounds, say=log)
    clean(directory)
    return {"samples": samples, "bytes": size}


# -- a resume: one load in a fresh process (--resume-rounds) ------------------------------------------
# The contenders of a resume, by the id `_resume_rounds` passes as --resume-as, and their labels.
RESUME = {
    "floor": "raw floor: parameters read into the live tensors, optimizer state into fresh memory",
    "floor_threads": "[info] raw floor, its reads shared by 2 threads (one per core here)",
    "warm": "[info] raw readinto into warm buffers (not a resume: no fresh process has them)",
    "ours": "ours",
    "ours_verify_first": "[info] ours, load_state(verify_first=True): every file verified before anything is restored",
    "accelerate": "Accelerate load_state (baseline)",
    "orbax": "Orbax StandardCheckpointer, zstd (baseline)",
    "orbax_uncompressed": "[info] Orbax, use_compression=False",
    "runai": "Run:ai Model Streamer (the same files)",
    "fastsafetensors": "fastsafetensors (the same files)",
}
PEERS = {"runai": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}  # id -> module
BASELINES = {"torch": ["accelerate"], "jax": ["orbax", "orbax_uncompressed"]}
RESUME_FLOOR_TARGET = 1.1  # issue 48: ours <= 1.1x the raw floor
RESUME_BASELINE_TARGET = 1.1  # at least 10% faster than Accelerate's / Orbax's load
RESUME_PEAK_TARGET = 256 * MB  # peak memory beyond the live state


def _layout(path: str) -> Tuple[int, Dict[str, Tuple[int, int]]]:
    """A safetensors file's data start and each tensor's byte span in the data (its header)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return 8 + length, {name: tuple(info["data_offsets"]) for name, info in header.items()}


def _state_files(directory: str) -> List[str]:
    """The files of the state a resume restores (the RNG's, a few bytes, only ours reads)."""
    return [os.path.join(directory, n) for n in sorted(os.listdir(directory))
            if n.endswith(".safetensors") and n.startswith(("model_", "optimizer_"))]


def _raw_floor(directory: str, live: Dict[str, Any], kept: List[Any], threads: int = 1) -> Callable[[], None]:
    """The floor of a resume (issue 48): the model's file read with one ``pread`` per tensor,
    straight into the memory of the live parameter of that name (``live``: writable NumPy views),
    and every other file of the state (the optimizer's) with ``pread`` (64 MiB at a time) into
    fresh memory of its size allocated inside the call, in ordinary pages (`private_array`, as
    ours: a plain ``np.empty`` of that size asks for transparent huge pages, whose first touch
    costs several times more on this VM and made the floor 2-9x slower than ours; the kernel
    zero-fills each page on its first touch, in the read), kept alive in ``kept`` as a restored
    state is. Nothing
    verified, nothing parsed but the headers. ``threads``: the reads shared among that many
    threads (1: one after the other in this thread)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from unified.checkpoint.safetensors_place import private_array

    def pread(fd: int, target: Any, offset: int) -> None:
        view, got = memoryview(target).cast("B"), 0
        while got < len(view):
            done = os.preadv(fd, [view[got:]], offset + got)
            if done <= 0:
                raise OSError(f"short read at {offset + got}")
            got += done

    def load() -> None:
        kept.clear()
        reads, fds = [], []
        try:
            for path in _state_files(directory):
                fds.append(os.open(path, os.O_RDONLY))
                if os.path.basename(path).startswith("model_"):
                    start, spans = _layout(path)
                    for name, (begin, end) in sorted(spans.items(), key=lambda item: item[1]):
                        assert live[name].nbytes == end - begin, name
                        reads.append((fds[-1], live[name], start + begin))
                else:
                    buffer = private_array(np.dtype(np.uint8), (os.path.getsize(path),))
                    kept.append(buffer)
                    reads += [(fds[-1], buffer[at:at + (64 << 20)], at) for at in range(0, len(buffer), 64 << 20)]
            if threads == 1:
                for read in reads:
                    pread(*read)
            else:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda read: pread(*read), reads))
        finally:
            for fd in fds:
                os.close(fd)
    return load


def _peer_tensors(peer: str, directory: str) -> Iterator[Tuple[str, Any]]:
    """``(name, CPU torch tensor)`` of every tensor of the state's files, read by a peer with its
    defaults, as its documentation shows for a CPU destination:

    * ``runai``: ``runai_model_streamer.SafetensorsStreamer().stream_files(paths, device="cpu")``
      (``owned=True``: each tensor is a view of a buffer handed to the caller, kept alive by it),
      then ``get_tensors()``, which yields them as their reads complete (its C++ workers read
      beside the consumer).
    * ``fastsafetensors``: ``SafeTensorsFileLoader(None, "cpu", nogds=True)``,
      ``add_filenames({0: paths})``, ``copy_files_to_device()`` (every file read into a CPU buffer
      of its size with pread through a bounce buffer, its threads), then ``get_tensor(name)`` (a
      view that keeps its file's buffer alive after ``close()``)."""
    paths = _state_files(directory)
    if peer == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(paths, device="cpu")
            yield from streamer.get_tensors()
        return
    from fastsafetensors import SafeTensorsFileLoader

    loader = SafeTensorsFileLoader(None, "cpu", nogds=True)
    try:
        loader.add_filenames({0: paths})
        files = loader.copy_files_to_device()
        try:
            for name in loader.get_keys():
                yield name, files.get_tensor(name)
        finally:
            files.close()
    finally:
        loader.close()


def _torch_resumer(model: Any, optimizer: Any) -> Tuple[Dict[str, Any], Callable[[Iterable[Tuple[str, Any]]], None]]:
    """The live parameters as writable NumPy views by their name in our files (``model_0/<key of
    state_dict()>``), and the restore a peer's tensors get on torch: each of the model's copied
    into its live parameter as it comes (``copy_``, what ``load_state_dict`` does), the
    optimizer's (``optimizer_0/state/<index>/<key>``) kept as they came (fresh memory: AdamW has
    no moments before its first step) and installed with ``optimizer.load_state_dict`` (the live
    ``param_groups``; it casts nothing: dtypes and device match)."""
    import torch

    params = {f"model_0/{key}": tensor for key, tensor in model.state_dict().items()}
    views = {name: tensor.numpy() for name, tensor in params.items()}

    def restore(tensors: Iterable[Tuple[str, Any]]) -> None:
        state: Dict[int, Dict[str, Any]] = {}
        with torch.no_grad():
            for name, tensor in tensors:
                if name.startswith("model_0/"):
                    params[name].copy_(tensor)
                else:
                    _, _, index, key = name.split("/")
                    state.setdefault(int(index), {})[key] = tensor
        optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})

    return views, restore


def _jax_names(obj: Any, prefix: str) -> List[str]:
    """The names in our files of an NNX object's state leaves, in ``tree_leaves`` order."""
    import jax
    from flax import nnx

    def word(key: Any) -> Optional[str]:
        if isinstance(key, jax.tree_util.GetAttrKey):
            return None if key.name == "value" else key.name
        for field in ("key", "idx"):
            if hasattr(key, field):
                return str(getattr(key, field))
        return str(key)

    return ["/".join([prefix] + [w for w in map(word, path) if w is not None])
            for path, _ in jax.tree_util.tree_flatten_with_path(nnx.state(obj))[0]]


def _jax_resumer(model: Any, optimizer: Any) -> Tuple[Dict[str, Any], Callable[[Iterable[Tuple[str, Any]]], None]]:
    """`_torch_resumer` for NNX: the live model arrays' own memory as writable NumPy views (through
    ``unsafe_buffer_pointer``: the raw floor writes into XLA's buffers behind its back, which only
    a floor may do), and the restore of a peer's torch tensors: each handed to JAX with
    ``jax.dlpack.from_dlpack`` (no copy where XLA accepts the memory's alignment, else a copy),
    then ``nnx.update`` of the model and of the optimizer with the new arrays (JAX arrays are
    immutable: a peer cannot read into the live ones)."""
    import ctypes

    import jax
    import numpy as np
    from flax import nnx

    objects = {"model_0": model, "optimizer_0": optimizer}
    names = {prefix: _jax_names(obj, prefix) for prefix, obj in objects.items()}
    views = {name: np.frombuffer((ctypes.c_char * leaf.nbytes).from_address(leaf.unsafe_buffer_pointer()), np.uint8)
             for name, leaf in zip(names["model_0"], jax_leaves(model)) if leaf.nbytes}

    def restore(tensors: Iterable[Tuple[str, Any]]) -> None:
        got = dict(tensors)
        for prefix, obj in objects.items():
            treedef = jax.tree_util.tree_structure(nnx.state(obj))
            nnx.update(obj, jax.tree_util.tree_unflatten(
                treedef, [jax.dlpack.from_dlpack(got.pop(name)) for name in names[prefix]]))
        assert not got, f"tensors left over: {sorted(got)[:3]}"

    return views, restore


def _checker(framework: str, model: Any, optimizer: Any, directory: str) -> Callable[[bool], None]:
    """After a resume, untimed: the first parameter (and with ``optimizer_too`` its first moment)
    must equal what the checkpoint's files hold (the baselines' checkpoints were saved from the
    same state, at the same moment)."""
    import numpy as np
    from safetensors import safe_open

    if framework == "torch":
        param, moment = "model_0/0.weight", "optimizer_0/state/0/exp_avg"

        def live(name: str) -> Any:
            if name == param:
                return model.state_dict()["0.weight"].numpy()
            return optimizer.state[next(model.parameters())]["exp_avg"].numpy()
    else:
        param, moment = "model_0/layers/0/kernel", "optimizer_0/opt_state/0/mu/layers/0/kernel"

        def live(name: str) -> Any:
            obj, prefix = (model, "model_0") if name == param else (optimizer, "optimizer_0")
            return np.asarray(jax_leaves(obj)[_jax_names(obj, prefix).index(name)])

    def check(optimizer_too: bool) -> None:
        for name in [param] + [moment] * optimizer_too:
            path = os.path.join(directory, name.split("/")[0] + ".safetensors")
            with safe_open(path, "np") as handle:
                assert np.array_equal(live(name), handle.get_tensor(name)), f"the resume did not restore {name}"

    return check


def _resume(args: argparse.Namespace, framework: str, ours: Any, objects: Tuple[Any, Any],
            baselines: Dict[str, Any]) -> Dict[str, float]:
    """``--save-to``: save ours, and each baseline (an object with ``save_state`` / ``load_state``)
    into ``<dir>.<name>`` beside it, and stop. ``--resume-from``: one load in this fresh process,
    as a resuming script does it (objects just built), by the `RESUME` id ``--resume-as``: its
    seconds and peak RSS beyond the live state (`runner.measured`: the peak above the larger of the
    memory before and after, kernel-exact, with no sampling thread beside the timed call, after a
    full garbage collection); then, untimed, the restored values checked (`_checker`)."""

    if args.save_to:
        ours.save_state(args.save_to)
        for name, baseline in baselines.items():
            baseline.save_state(f"{args.save_to}.{name}")
        return {}
    directory, which = args.resume_from, args.resume_as
    live, restore = (_torch_resumer if framework == "torch" else _jax_resumer)(*objects)
    kept: List[Any] = []  # the raw floor's fresh memory, alive as a restored state is
    if which in baselines:
        load = lambda: baselines[which].load_state(f"{directory}.{which}")  # noqa: E731
    elif which == "warm":
        load = _raw_reader(directory)  # its buffers are allocated and touched here, untimed
    elif which in ("floor", "floor_threads"):
        load = _raw_floor(directory, live, kept, threads=1 if which == "floor" else 2)
    elif which in PEERS:
        import importlib

        # the imports (torch's too, on JAX) are not a load's work: untimed
        for name in ["torch", PEERS[which]] + ["fastsafetensors.frameworks._torch"] * (which == "fastsafetensors"):
            importlib.import_module(name)
        load = lambda: restore(_peer_tensors(which, directory))  # noqa: E731
    else:  # "ours" (one pass) or "ours_verify_first" (the old order: verify everything, then restore)
        load = lambda: ours.load_state(directory, verify_first=which == "ours_verify_first")  # noqa: E731
    got = measured(load)
    if which != "warm":
        _checker(framework, *objects, directory)(optimizer_too=not which.startswith("floor"))
    del kept
    return {"seconds": got["s"], "peak": float(beyond(got))}


class _Orbax:
    """Orbax as a resume's baseline: ``save_state`` / ``load_state`` of the NNX ``objects`` as
    `checkpointing.orbax_contenders` time them (``StandardCheckpointer``, or
    ``PyTreeCheckpointHandler(use_compression=False)``; the restore takes the abstract tree of the
    live state, then ``nnx.update`` of every object)."""

    def __init__(self, objects: Dict[str, Any], compressed: bool) -> None:
        import orbax.checkpoint as ocp

        self.objects, self.compressed = objects, compressed
        self.checkpointer = (ocp.StandardCheckpointer() if compressed
                             else ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False)))

    def _state(self) -> Dict[str, Any]:
        from flax import nnx

        return {name: nnx.state(obj) for name, obj in self.objects.items()}

    def save_state(self, path: str) -> None:
        self.checkpointer.save(os.path.abspath(path), self._state())
        self.checkpointer.wait_until_finished()

    def load_state(self, path: str) -> None:
        import jax
        import orbax.checkpoint as ocp
        from flax import nnx

        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, self._state())
        if self.compressed:
            restored = self.checkpointer.restore(os.path.abspath(path), target)
        else:
            restored = self.checkpointer.restore(os.path.abspath(path), args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
        for name, obj in self.objects.items():
            nnx.update(obj, restored[name])


def _measure(args: argparse.Namespace, framework: str, contenders: Dict[str, Callable[..., Any]], ours: Any,
             probe: Any, before: Callable[[], Any], **facts: Any) -> Dict[str, Any]:
    """A part's timed rounds (with their medians, sizes on disk and the memory round), load
    comparison and profile."""
    base = os.path.join(args.dir, framework)
    os.makedirs(base, exist_ok=True)
    result: Dict[str, Any] = {}
    if args.repeats:
        result = path_rounds(contenders, base, args.repeats, size=stored_bytes, memory=True)
        result["median"] = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in result["samples"].items()}
    if args.load_rounds:
        log("  load comparison")
        result["loads"] = _compare_loads(ours, os.path.join(base, "loads"), probe, args.load_rounds, before)
    log("  profile")
    result["profile"] = min_phases([_profile(ours, os.path.join(base, "profile"), probe)
                                    for _ in range(max(1, args.profile_passes))]) if args.profile_passes else {}
    return {**result, "framework": framework, "hidden": args.hidden, **facts}


def min_phases(runs: List[Dict[str, float]]) -> Dict[str, float]:
    """The minimum of every phase over profile passes (the least disturbed estimate)."""
    return {phase: min(run[phase] for run in runs) for phase in runs[0]}


# -- torch --------------------------------------------------------------------------------------------
def _torch_before(ours: Any) -> Any:
    """The torch restore before issue 11 finding 4: optimizer moments copied into the optimizer's
    existing tensors, other arrays copied, the model's copied by load_state_dict."""
    import numpy as np
    import torch

    from backends.torch.tensors import tensor_from_numpy
    from unified.runtime.tree import flatten

    backend = ours._backend

    def load_state_into(kind: str, obj: Any, state: Any) -> None:
        if kind == "optimizer":
            live = obj.state_dict().get("state", {})
            for index, values in state.get("state", {}).items():
                for key, value in list(values.items()):
                    tensor = live.get(index, {}).get(key)
                    if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == value.shape and tensor.dim():
                        tensor.copy_(tensor_from_numpy(value))
                        values[key] = tensor
        leaves, rebuild = flatten(state, lambda x: not isinstance(x, (dict, list, tuple)))
        tensors = [tensor_from_numpy(x if kind == "model" else np.array(x)) if isinstance(x, np.ndarray) else x
                   for x in leaves]
        (backend.unwrap_model(obj) if kind == "model" else obj).load_state_dict(rebuild(tensors))

    return patched((backend, "load_state_into", load_state_into))


def torch_part(args: argparse.Namespace) -> Dict[str, Any]:
    import accelerate
    import torch

    import unified

    model, optimizer, layers = torch_objects(args.size_gb, args.hidden, step=not args.resume_from)
    ours = unified.Accelerator(backend="torch")
    ours.prepare(model, optimizer)
    theirs = accelerate.Accelerator(cpu=True)
    theirs.prepare(model, optimizer)
    if args.save_to or args.resume_from:
        return _resume(args, "torch", ours, (model, optimizer), {"accelerate": theirs})
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in torch_tensors(model, optimizer))
    log(f"torch: {layers} x Linear({args.hidden}, {args.hidden}), parameters {param_bytes / GB:.3f} GB, "
        f"model+optimizer state {state_bytes / GB:.3f} GB")
    probe = torch_probe(model, optimizer)
    contenders = {"ours": contender(ours.save_state, ours.load_state, probe),
                  "accelerate": contender(theirs.save_state, theirs.load_state, probe),
                  "ours_async": async_contender(ours), "dcp": dcp_contender(model, optimizer, probe),
                  "raw": raw_limit(lambda: torch_arrays(model, optimizer))}
    with warnings.catch_warnings():  # DCP in one process says it assumes one process, every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return _measure(args, "torch", contenders, ours, probe, lambda: _torch_before(ours), state_bytes=state_bytes,
                        layers=layers, versions={"torch": torch.__version__, "accelerate": accelerate.__version__})


# -- jax ----------------------------------------------------------------------------------------------
def jax_part(args: argparse.Namespace) -> Dict[str, Any]:
    import flax
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    import unified

    resuming = bool(args.save_to or args.resume_from)
    model, optimizer, layers = jax_objects(args.size_gb, args.hidden, step=not resuming)
    ours = unified.Accelerator(backend="jax")
    model, optimizer = ours.prepare(model, optimizer)
    if resuming:  # the JAX restore itself did not change: only the reader differs
        baselines = {name: _Orbax({"model": model, "optimizer": optimizer}, compressed=name == "orbax")
                     for name in BASELINES["jax"] if args.save_to or args.resume_as == name}
        try:
            return _resume(args, "jax", ours, (model, optimizer), baselines)
        finally:
            for baseline in baselines.values():
                baseline.checkpointer.close()
    state_bytes = sum(int(leaf.nbytes) for leaf in jax_leaves(model) + jax_leaves(optimizer))
    param_bytes = sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    log(f"jax: {layers} x nnx.Linear({args.hidden}, {args.hidden}), parameters {param_bytes / GB:.3f} GB, "
        f"model+optimizer state {state_bytes / GB:.3f} GB (jax {jax.__version__}, devices {jax.devices()})")
    probe = jax_probe(model, optimizer)
    orbax, close = orbax_contenders({"model": model, "optimizer": optimizer}, probe)
    contenders = {"ours": contender(ours.save_state, ours.load_state, probe), "orbax": orbax["orbax"],
                  "ours_async": async_contender(ours), "orbax_uncompressed": orbax["orbax_uncompressed"],
                  "raw": raw_limit(lambda: jax_arrays(model, optimizer))}
    try:
        return _measure(args, "jax", contenders, ours, probe, patched, state_bytes=state_bytes, layers=layers,
                        versions={"jax": jax.__version__, "flax": flax.__version__,
                                  "orbax-checkpoint": ocp.__version__})
    finally:
        close()


# -- parent: run the parts, print the report ----------------------------------------------------------
def _speedup(ours: float, baseline: float) -> str:
    return f"{baseline / ours:.2f}x" if ours > 0 else "-"


def _load_table(results: List[Dict[str, Any]], key: str) -> List[str]:
    """A load comparison (`_compare_loads`: ``loads``; `_resume_rounds`: ``resume``): every
    contender's min / median / max and spread, its median against the raw floor's (a resume:
    parameters into the live tensors, the optimizer's state into fresh memory) and against the
    raw read into warm buffers, and its peak RSS beyond the live state."""
    rows = []
    for res in results:
        loads = res.get(key)
        if not loads:
            continue
        samples = loads["samples"]
        floor = statistics.median(samples[RESUME["floor"]]) if RESUME["floor"] in samples else None
        warm = samples.get(RESUME["warm"], samples.get("raw readinto (limit)"))
        warm_median = statistics.median(warm) if warm else None
        peaks = loads.get("peaks", {})
        for name, values in samples.items():
            peak = (f"{statistics.median(peaks[name]) / MB:,.0f} ({max(peaks[name]) / MB:,.0f})" if peaks.get(name)
                    else "-")
            ratios = [cells(values, "ratio", ref, ratio_digits=2)[0] if ref else "-" for ref in (floor, warm_median)]
            rows.append([f"{res['framework']} ({loads['bytes'] / GB:.2f} GB)", name, len(values),
                         *cells(values, "min median max spread"), *ratios, peak])
        rows.append(["", "samples (s)", json.dumps({n: [round(x, 3) for x in v] for n, v in samples.items()}),
                     "", "", "", "", "", "", ""])
        if loads.get("peer_versions"):
            rows.append(["", "peers' versions", json.dumps(loads["peer_versions"]), "", "", "", "", "", "", ""])
    header = ["framework", "load of", "rounds", "min (s)", "median (s)", "max (s)", "spread (max/min)",
              "median / raw floor", "median / warm raw read", "peak RSS beyond the live state, median (max), MB"]
    return table(header, "llrrrrrrrr", rows).splitlines() if rows else []


def _side_by_side(res: Dict[str, Any]) -> List[str]:
    """Every synchronous contender of one framework in one table: save and load (median, min-max,
    median against the raw limit's) and the peak memory of each beyond the live state (the
    memory round)."""
    samples, memory = res["samples"], res.get("memory", {})
    names = [n for n in ("ours", "accelerate", "orbax", "orbax_uncompressed", "dcp", "raw") if n in samples]
    limit = ({op: statistics.median(samples["raw"][op]) for op in ("save_state", "load_state")} if "raw" in samples
             else {})
    rows = []
    for name in names:
        row = [res["framework"], NAMES[name]]
        for op in ("save_state", "load_state"):
            row += cells(samples[name][op], "median min-max ratio" if limit else "median min-max", limit.get(op),
                         ratio_digits=2) + ([] if limit else ["-"])
        for key in (MEMORY_RSS, MEMORY_ANON):
            row.append(" / ".join(f"{memory.get(name, {}).get(f'{op} {key}', 0) / MB:,.0f}"
                                  for op in ("save_state", "load_state")))
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
        plot.draw(plot.image("checkpoint"),
                  "save_state / load_state: ours, Accelerate and torch DCP (torch), Orbax (JAX), the raw limit",
                  "seconds", rounds)
    for key, part, what in (("loads", "loads", "repeated in one process"),
                            ("resume", "resume", "each in a fresh process (a resume)")):
        loads = {f"{res['framework']} ({res[key]['bytes'] / GB:.2f} GB)": res[key]["samples"]
                 for res in results if res.get(key)}
        if loads:
            plot.draw(plot.image("checkpoint", part), f"load_state against the raw read limit, {what}", "seconds",
                      loads)


def report(results: List[Dict[str, Any]]) -> str:
    rows, extra = [], []
    for res in results:
        if "median" not in res:  # --repeats 0
            continue
        fw, med = res["framework"], res["median"]
        base_name = "accelerate" if fw == "torch" else "orbax"
        for op in ("save_state", "load_state"):
            ours, base = med["ours"][op], med[base_name][op]
            need = TARGETS[(fw, op)]
            rows.append([fw, f"{op} (vs {base_name})", f"{ours:.3f}", f"{base:.3f}", _speedup(ours, base),
                         f">= {need:g}x", "yes" if base / ours >= need else "NO"])
        if fw == "jax":
            for op in ("save_state", "load_state"):
                ours, base = med["ours"][op], med["orbax_uncompressed"][op]
                rows.append([fw, f"{op} (info: vs orbax PyTreeCheckpointHandler(use_compression=False))", f"{ours:.3f}",
                             f"{base:.3f}", _speedup(ours, base), "", ""])
        block, wait, sync = (med["ours_async"]["async blocking"], med["ours_async"]["async wait"],
                             med["ours"]["save_state"])
        rows.append([fw, "save_state(async_save=True) blocking (vs our sync save)", f"{block:.3f}", f"{sync:.3f}",
                     f"{block / sync:.1%} of sync", f"<= {ASYNC_TARGET:.0%}",
                     "yes" if block / sync <= ASYNC_TARGET else "NO"])
        rows.append([fw, "wait_for_checkpoint after it", f"{wait:.3f}", "", "", "", ""])
        gb = res["state_bytes"] / GB
        extra.append(f"\n{fw}: {res['layers']} x Linear({res['hidden']}, {res['hidden']}), state {gb:.3f} GB; "
                     f"versions {res['versions']}")
        extra += table(["contender", "files", "bytes on disk (apparent)", "allocated", "save GB/s (median)",
                        "load GB/s (median)", "save min (s)", "load min (s)"], "lrrrrrrr",
                       [[name, d["files"], f"{d['apparent']:,}", f"{d['allocated']:,}",
                         f"{gb / med[name]['save_state']:.2f}", f"{gb / med[name]['load_state']:.2f}",
                         f"{min(s['save_state']):.3f}", f"{min(s['load_state']):.3f}"]
                        for name in [n for n in ("ours", base_name, "orbax_uncompressed", "dcp", "raw")
                                     if n in res["disk"]]
                        for d, s in [(res["disk"][name], res["samples"][name])]]).splitlines()
        extra.append("samples (s): " + json.dumps({n: {k: [round(x, 3) for x in v] for k, v in s.items()}
                                                   for n, s in res["samples"].items()}))
        extra.append(f"\n{fw}: every contender side by side (the limit: the same bytes written with one write per "
                     f"array, read with readinto into warm memory; peak memory: {PeakMemory.method} for RSS, RssAnon "
                     "sampled every 2 ms, in one more untimed round after the C heap handed its free memory back)")
        extra += _side_by_side(res)
    for res in results:
        if res.get("profile"):
            extra.append(f"\n{res['framework']}: profile of ours (phase by phase; minimum of each phase over the "
                         "profile passes, seconds)")
            extra += table(["phase", "s"], "lr",
                           [[phase, f"{s:.3f}"] for phase, s in res["profile"].items()]).splitlines()
    loads = _load_table(results, "loads")
    if loads:
        extra += ["\nload_state against the raw read limit and the reader before issue 11 finding 4, repeated in "
                  "one process (interleaved rounds, rotated order)", *loads]
    resumes = _load_table(results, "resume")
    if resumes:
        extra += ["\neach load in a fresh process that has just built its objects, as a resuming script does "
                  "(interleaved rounds, rotated order; the raw floor: the model's file read into the live "
                  "parameters, the optimizer's into fresh memory; the warm raw read: every file into buffers "
                  "touched before the timing; the peers read ours' model and optimizer files)", *resumes]
        extra += ["\nissue 48's measures of a resume (medians of the rounds above)", *_resume_verdict(results)]
    header = ["framework", "operation", "ours (s)", "baseline (s)", "speed-up", "target", "met"]
    return "\n".join((table(header, "llrrrll", rows).splitlines() if rows else []) + extra)


def _resume_rounds(cmd: List[str], part: str, directory: str, rounds: int) -> Dict[str, Any]:
    """Save once (ours, and the baselines beside it), then ``rounds`` rounds (rotated order) of one
    process per contender that builds the objects and times one load (`_resume`). The peers of
    `PEERS` that are not installed are left out (and named in the log)."""
    import importlib.metadata
    import importlib.util

    run_part(cmd + ["--save-to", directory])
    peers = [p for p in PEERS if importlib.util.find_spec(PEERS[p]) is not None]
    for peer in sorted(set(PEERS) - set(peers)):
        log(f"  {RESUME[peer]}: not installed (pip install '.[bench]'), left out")
    names = ["floor", "floor_threads", "warm", "ours", "ours_verify_first"] + BASELINES[part] + peers
    got = interleaved({name: (lambda name=name: run_part(cmd + ["--resume-from", directory, "--resume-as", name]))
                       for name in names},
                      rounds, warmup=0, say=log, describe=lambda g: f"{g['seconds']:.3f}s {g['peak'] / MB:,.0f} MB")
    size = sum(os.path.getsize(path) for path in _state_files(directory))
    clean(directory)
    for name in BASELINES[part]:
        clean(f"{directory}.{name}")
    return {"samples": {RESUME[n]: [g["seconds"] for g in v] for n, v in got.items()},
            "peaks": {RESUME[n]: [g["peak"] for g in v] for n, v in got.items()}, "bytes": size,
            "peer_versions": {PEERS[p]: importlib.metadata.version(PEERS[p].replace("_", "-")) for p in peers}}


def _resume_verdict(results: List[Dict[str, Any]]) -> List[str]:
    """Issue 48's measures of a resume, per framework and size, from the medians of the fresh-process
    rounds: ours <= 1.1x the raw floor; at least 10% faster than the baseline (Accelerate, Orbax's
    default; the uncompressed Orbax for information); ahead of the fastest installed safetensors
    peer reading the same files; ours' peak RSS beyond the live state <= 256 MB (its worst round)."""
    rows = []
    for res in results:
        resume = res.get("resume")
        if not resume:
            continue
        samples, peaks = resume["samples"], resume.get("peaks", {})
        where = f"{res['framework']} ({resume['bytes'] / GB:.2f} GB)"
        median = {name: statistics.median(values) for name, values in samples.items()}
        ours = median[RESUME["ours"]]

        def met(ok: bool) -> str:
            return "yes" if ok else "**NO**"

        floor = median.get(RESUME["floor"])
        if floor:
            rows.append([where, "ours / raw floor (median)", f"{ours:.3f}", f"{floor:.3f}", f"{ours / floor:.2f}x",
                         f"<= {RESUME_FLOOR_TARGET:g}x", met(ours <= RESUME_FLOOR_TARGET * floor)])
        for name in BASELINES[res["framework"]]:
            if RESUME[name] in median:
                base, info = median[RESUME[name]], RESUME[name].startswith("[info]")
                rows.append([where, f"{RESUME[name]} / ours (speed-up)", f"{ours:.3f}", f"{base:.3f}",
                             f"{base / ours:.2f}x", "" if info else f">= {RESUME_BASELINE_TARGET:g}x",
                             "" if info else met(base >= RESUME_BASELINE_TARGET * ours)])
        installed = [RESUME[p] for p in PEERS if RESUME[p] in median]
        if installed:
            fastest = min(installed, key=median.get)
            rows.append([where, f"fastest peer: {fastest} / ours (speed-up)", f"{ours:.3f}", f"{median[fastest]:.3f}",
                         f"{median[fastest] / ours:.2f}x", "> 1x", met(median[fastest] > ours)])
        else:
            rows.append([where, "fastest peer", f"{ours:.3f}", "-", "-", "> 1x", "not measured (none installed)"])
        checked_first = median.get(RESUME["ours_verify_first"])
        if checked_first:  # what the option to keep the live state on a failed load costs
            rows.append([where, "[info] ours with verify_first=True / ours", f"{ours:.3f}", f"{checked_first:.3f}",
                         f"{checked_first / ours:.2f}x", "", ""])
        if peaks.get(RESUME["ours"]):
            peak = max(peaks[RESUME["ours"]])
            rows.append([where, "ours: peak RSS beyond the live state, worst round (MB)", f"{peak / MB:,.0f}", "", "",
                         f"<= {RESUME_PEAK_TARGET / MB:,.0f}", met(peak <= RESUME_PEAK_TARGET)])
    header = ["framework (state)", "measure (issue 48)", "ours", "other", "ratio", "target", "met"]
    return table(header, "llrrrll", rows).splitlines() if rows else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", default="1.5",
                        help="model + optimizer state per framework (GB); comma-separated sizes (0.5,1.5) run every "
                             "part at each size, one after the other, in one run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None,
                        help="where checkpoints are written (default: a new temporary directory)")
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
                        help="load_state's reader threads per file (unified's default: min(4, CPUs)), "
                             "to measure the choice")
    parser.add_argument("--part", choices=["torch", "jax"], help=argparse.SUPPRESS)
    parser.add_argument("--save-to", help=argparse.SUPPRESS)
    parser.add_argument("--resume-from", help=argparse.SUPPRESS)
    parser.add_argument("--resume-as", help=argparse.SUPPRESS)
    plot.add_option(parser)
    args = parser.parse_args()

    if args.part:
        from unified.checkpoint import safetensors_read

        args.size_gb = float(args.size_gb)

        if args.read_chunk_mib:
            safetensors_read._READ_CHUNK = args.read_chunk_mib << 20
        if args.readers:
            safetensors_read._READERS = args.readers
        emit((torch_part if args.part == "torch" else jax_part)(args))
        return

    print_command()
    own_dir = args.dir is None
    directory = tempfile.mkdtemp(prefix="unified-ckpt-bench-") if own_dir else os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    run, results = Run(), []
    try:
        for size, part in [(size, p) for size in args.size_gb.split(",") for p in args.parts.split(",") if p]:
            log(f"== {part}, {float(size):g} GB ==")
            cmd = module("checkpoint", "--part", part, "--size-gb", size, "--repeats", str(args.repeats),
                         "--dir", directory, "--hidden", str(args.hidden), "--profile-passes", str(args.profile_passes),
                         "--load-rounds", str(args.load_rounds))
            cmd += [f"--{name}={value}" for name, value in (("read-chunk-mib", args.read_chunk_mib),
                                                             ("readers", args.readers)) if value]
            try:
                results.append(run_part(cmd))
                if args.resume_rounds:
                    log(f"  loads in fresh processes ({part})")
                    results[-1]["resume"] = _resume_rounds(cmd, part, os.path.join(directory, f"resume_{part}_{size}"),
                                                           args.resume_rounds)
            except PartFailed as failure:
                sys.exit(f"{part} part failed ({failure})")
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
    print(run.machine(f"--size-gb {args.size_gb} --repeats {args.repeats} --load-rounds {args.load_rounds} "
                      f"--resume-rounds {args.resume_rounds} --hidden {args.hidden}"))
    print(report(results))
    if not args.no_picture:
        picture(results)


if __name__ == "__main__":
    main()
