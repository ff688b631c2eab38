"""Sharded ``save_state`` / ``load_state`` on 2 processes against raw ``torch.distributed.checkpoint``
(torch, FSDP2) and raw Orbax (JAX), peak RSS per process during a save, and the reshard cost.

Run from the repository root:

    python benchmarks/sharded_checkpoint.py [--size-gb 1.5] [--repeats 3] [--parts torch,jax]
                                            [--dir DIR] [--hidden 2304]

For each part the script launches itself twice with ``python -m unified launch``: a group of 2
processes (every contender, then our reshard source) and a group of 3 (our load of that 2-process
checkpoint). Loopback only. Process 0 of each group prints one JSON line with every process's
samples; the parent prints markdown tables and draws docs/benchmarks/img/sharded_checkpoint.png
(benchmarks/plot.py).

What is measured (CPU, gloo / JAX's CPU collectives, page cache warm):

* torch: ``nn.Sequential`` of ``nn.Linear(H, H)`` holding ``size_gb / 3`` GB of float32
  parameters and ``torch.optim.AdamW`` after one real step, so the whole state is about
  ``size_gb``. Prepared once by ``unified.Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
  transformer_cls_names_to_wrap=["Linear"]))``: FSDP2 (``fully_shard`` per layer, then the root)
  over both processes, each holding half of every array. Contenders on that same sharded state:
  ``ours`` (``save_state`` / ``load_state``: DCP with its safetensors storage plus our manifest,
  checksums and atomic commit); ``dcp`` (``get_state_dict(model, optimizer)`` then
  ``dcp.save({"model": ..., "optimizer": ...}, checkpoint_id=dir)`` with the default
  ``FileSystemWriter``; load: ``dcp.load`` into ``get_state_dict``'s tensors then
  ``set_state_dict``); ``dcp_safetensors`` (the same with ``HuggingFaceStorageWriter(dir,
  save_distributed=True)`` / ``HuggingFaceStorageReader``, the storage we use; it takes tensors
  only, so the state dicts' tensor leaves under dotted names: the optimizer's hyper-parameters are
  not saved and ``set_state_dict`` keeps the live ones). Accelerate's FSDP save
  (``accelerate.Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
  state_dict_type="SHARDED_STATE_DICT"))``) would be one where Accelerate turns FSDP on for the process
  group; Accelerate 1.15 does not on CPU (FSDP only for accelerator device types: the plugin is
  ignored and ``prepare`` would wrap the model in DDP), so the script prints that reason, asked of
  Accelerate at run time, and leaves the column out.
* jax: ``nnx.Linear(H, H)`` layers of the same bytes plus ``nnx.Optimizer(model, optax.adamw(1e-3),
  wrt=nnx.Param)`` after one jitted update, prepared by ``unified.Accelerator(fsdp_plugin=...)``:
  every array split over the 2 processes' CPU devices. Contenders: ``ours``; ``orbax``
  (``ocp.StandardCheckpointer`` saving ``{"model": nnx.state(model), "optimizer":
  nnx.state(optimizer)}`` + ``wait_until_finished()``, restored with the abstract tree (shapes,
  dtypes, shardings) then ``nnx.update``: its default compresses chunks with zstd); ``orbax_uncompressed``
  (``PyTreeCheckpointHandler(use_compression=False)``, what our Orbax write uses).

``H`` (``--hidden``, default 2304) is divisible by 2 and 3, so every array is split on 2 and on 3
processes alike (JAX keeps an array whole when the device count divides none of its dimensions).

Fairness (as benchmarks/checkpoint.py): one untimed warm-up round of every contender, then
``--repeats`` rounds in rotated order; each contender's save is followed by its load; then process 0
deletes its directory, calls ``os.sync()`` and waits for ``Dirty:`` in /proc/meminfo to fall
(outside the timings). Every process starts each timed call together (a barrier first) and times
its own call; a round's sample is the slowest process's time (the collective ends with it). Every
load is checked: a parameter and an optimizer moment are changed after the save and must come back.

Peak RSS: before each timed save or load every process writes ``5`` to /proc/self/clear_refs,
which resets ``VmHWM`` in /proc/self/status to the current RSS; after the call ``VmHWM`` is the
call's peak (kernel-exact, no sampling; where clear_refs cannot be written the script samples
``VmRSS`` every 2 ms in a thread and says so). Reported against the process's own shard bytes
(its addressable part of every array) and the whole state.

Reshard: after the rounds, ours saves once more and both groups time ``load_state`` of that
checkpoint (one warm-up load, then ``--repeats``): the 2-process group (2 -> 2) and a fresh
3-process group (2 -> 3: DCP / Orbax read every process's new slices out of the saved shards).
Loads are checked against the saved values (process 0 of the saving group wrote the full first
kernel and its first moment as ``.npy``).

Profile: one more save and load of ours with the phases of ``unified.checkpoint.manager`` timed
on every process (nested phases are contained in their parent's time).

``--store`` (issue 29): the same state to an S3-compatible object store instead of a folder. The
parent starts moto's S3 server on 127.0.0.1 in a process of its own (as
benchmarks/store_checkpoint.py does) and the checkpoints go under ``s3://<bucket>/sharded``.
Contenders: ``ours`` (``save_state("s3://…")``: every process streams its own shards to one
object, the manifest commits; ``load_state`` verifies every byte before restoring); ``raw`` (the
limit: every process uploads its own shards' bytes with the same client, s3fs, as one streamed
multipart upload of 32 MiB parts, and downloads them into warm buffers: nothing hashed, framed or
restored); torch: ``dcp_fsspec`` (``dcp.save`` / ``dcp.load`` with DCP's ``FsspecWriter`` /
``FsspecReader`` on the same URL). Orbax cannot write to ``s3://`` (the JAX part says why). No
reshard group and no profile in this mode. Goal: ours within 1.3x raw, ahead of DCP's fsspec.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
from checkpoint import _clean, _disk_bytes, nnx_stack  # noqa: E402  (benchmarks/ is not a package)
from launched import report as _report, run_launched  # noqa: E402
from memory import PeakMemory as PeakRSS, return_free_heap, status_bytes  # noqa: E402

GB = 1e9
PICTURE = ROOT / "docs" / "benchmarks" / "img" / "sharded_checkpoint.png"
STORE_PICTURE = ROOT / "docs" / "benchmarks" / "img" / "sharded_store_checkpoint.png"
GOAL = 1.1  # from issue 13: ours no slower than raw DCP / Orbax, <= 1.1x
# the raw contenders the goal is measured against; the others are for information
RAW = {"torch": ("dcp", "dcp_safetensors"), "jax": ("orbax",)}
STORE_GOAL = 1.3  # issue 29: on a store, ours within 1.3x the raw transfer...
STORE_RAW = {"torch": ("raw",), "jax": ("raw",)}
STORE_PEERS = ("dcp_fsspec",)  # ...and ahead of these


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


def _remove(path: str) -> None:
    """A checkpoint folder, or every object under a store prefix."""
    if "://" not in path:
        _clean(path)
        return
    from store_checkpoint import _delete

    _delete(path)


def _stored_bytes(path: str) -> Dict[str, int]:
    """`_disk_bytes` of a folder; a store prefix's objects (allocated: their sizes)."""
    if "://" not in path:
        return _disk_bytes(path)
    import fsspec

    fs = fsspec.filesystem(path.split("://", 1)[0])
    fs.invalidate_cache()
    sizes = [int(info["size"]) for info in fs.find(path, detail=True).values()]
    return {"files": len(sizes), "apparent": sum(sizes), "allocated": sum(sizes)}


def raw_store_contender(rank: int, arrays: Callable[[], List[Any]]) -> "Contender":
    """The limit on a store: this process's own shards' bytes (``arrays()``: NumPy views) streamed
    to one object with s3fs, read back into a warm buffer of the object's size (the upload and
    download of benchmarks/store_checkpoint.py's raw limit)."""
    from store_checkpoint import _store, download_raw, upload_raw

    buffer = bytearray()

    def save(path: str) -> None:
        upload_raw(_store(), f"{path}/raw-{rank}.bin", arrays())

    def load(path: str) -> None:
        nonlocal buffer
        fs = _store()
        fs.invalidate_cache()
        buffer = download_raw(fs, f"{path}/raw-{rank}.bin", buffer)

    return Contender(save, load, restores=False)


def _log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- what every worker does ---------------------------------------------------------------------------
class Contender:
    """A save and a load of one way to write the same sharded state (paths: one directory).
    ``settle`` runs after the save, untimed: what the save left running in the background (our
    fsync of the committed checkpoint) must not slow the load timed next. ``restores``: False for
    the raw transfer, whose load reads the bytes into a buffer of its own (the state is neither
    changed before it nor checked after it)."""

    def __init__(self, save: Callable[[str], None], load: Callable[[str], None],
                 settle: Callable[[], None] = lambda: None, restores: bool = True) -> None:
        self.save, self.load, self.settle, self.restores = save, load, settle, restores


class Group:
    """The worker's view of its process group: barriers through our Accelerator, a directory
    removed by process 0 (with ``os.sync()`` and the wait for writeback) while the others wait."""

    def __init__(self, accelerator: Any) -> None:
        self.acc = accelerator
        self.rank = accelerator.process_index

    def barrier(self) -> None:
        self.acc.wait_for_everyone()

    def clean(self, path: str) -> None:
        self.barrier()
        if self.rank == 0:
            _remove(path)
        self.barrier()

    def timed(self, fn: Callable[[], Any]) -> Dict[str, float]:
        """``fn`` started together on every process; this process's seconds and memory."""
        self.barrier()
        # RSS alone: no sampler beside the timed call. The C heap's free memory is handed back
        # first (untimed), or memory an earlier round freed would be reused unseen; and again
        # after, so that "after" is the live state (the arrays a JAX load replaced are freed).
        with PeakRSS(trim=True, anonymous=False) as rss:
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
        return_free_heap()
        return {"s": seconds, "rss_before": rss.before, "rss_peak": rss.peak, "rss_after": status_bytes("VmRSS")}


def ours_contender(acc: Any) -> Contender:
    """``save_state`` / ``load_state``; a save returns durable (fsynced), so nothing is left to settle."""
    return Contender(lambda p: acc.save_state(p), lambda p: acc.load_state(p))


def run_rounds(group: Group, contenders: Dict[str, Contender], base: str, repeats: int,
               mutate: Callable[[], None], check: Callable[[], None]) -> Dict[str, Any]:
    """Warm-up, then ``repeats`` rounds in rotated order of save, mutate, load, check, clean."""
    names = list(contenders)

    def round_trip(name: str, path: str) -> Dict[str, Dict[str, float]]:
        c = contenders[name]
        save = group.timed(lambda: c.save(path))
        c.settle()
        if c.restores:
            mutate()
        load = group.timed(lambda: c.load(path))
        if c.restores:
            check()
        return {"save": save, "load": load}

    for name in names:
        if group.rank == 0:
            _log(f"  warm-up {name}")
        round_trip(name, _join(base, f"warmup_{name}"))
        group.clean(_join(base, f"warmup_{name}"))
    samples: Dict[str, Dict[str, List[Dict[str, float]]]] = {n: {"save": [], "load": []} for n in names}
    disk: Dict[str, Dict[str, int]] = {}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            path = _join(base, f"{name}_{r}")
            got = round_trip(name, path)
            group.barrier()
            if group.rank == 0:
                disk[name] = _stored_bytes(path)
                _log(f"  round {r} {name}: save {got['save']['s']:.3f}s, load {got['load']['s']:.3f}s (process 0)")
            group.clean(path)
            for op in ("save", "load"):
                samples[name][op].append(got[op])
    return {"samples": samples, "disk": disk}


def timed_loads(group: Group, load: Callable[[], None], mutate: Callable[[], None], check: Callable[[], None],
                repeats: int) -> List[Dict[str, float]]:
    """One warm-up load, then ``repeats`` timed ones, each after ``mutate`` and checked."""
    out = []
    for r in range(repeats + 1):
        mutate()
        got = group.timed(load)
        check()
        if r:
            out.append(got)
    return out


class Phases:
    """Time calls of the given ``(object, attribute, label)`` while the block runs (every call
    of the attribute adds to its label); the attributes are put back afterwards."""

    def __init__(self, targets: Sequence[Tuple[Any, str, str]]) -> None:
        self.targets = targets
        self.seconds: Dict[str, float] = {}
        self.saved: List[Tuple[Any, str, Any]] = []

    def __enter__(self) -> "Phases":
        for obj, attr, label in self.targets:
            self.saved.append((obj, attr, vars(obj).get(attr, _MISSING)))  # a module's function, or nothing
            setattr(obj, attr, self._wrap(getattr(obj, attr), label))
        return self

    def _wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
        return timed

    def __exit__(self, *exc: Any) -> None:
        for obj, attr, own in reversed(self.saved):
            if own is _MISSING:
                delattr(obj, attr)  # a method of the class again
            else:
                setattr(obj, attr, own)


_MISSING = object()


def profile_ours(group: Group, directory: str, mutate: Callable[[], None], check: Callable[[], None]) -> Dict[str, float]:
    """One save and one load of ours, phase by phase (this process's seconds)."""
    from unified.checkpoint import safetensors_io

    acc = group.acc
    manager = acc._checkpoints
    save_targets = [
        (manager, "safe_snapshot", "save: snapshot (get_state + encode; collective)"),
        (manager, "begin", "save: begin (token broadcast)"),
        (safetensors_io, "write", "save: . safetensors_io.write (our files: unsharded values, RNG; torch: also the "
                                  "shard file, inside the next)"),
        (manager.sharding, "save_sharded", "save: . the backend's sharded write (DCP / Orbax; collective)"),
        (manager, "write_part", "save: write_part (contains the two above)"),
        (manager, "_hash_share", "save: xxh3 of this process's share of the shard files (second pass)"),
        (manager.collectives, "all_gather_json", "save: reports and checksums gathered (wait for the slowest process)"),
        (manager, "_commit", "save: manifest + rename (main process; others wait in share_failure)"),
    ]
    load_targets = [
        (manager, "resolve_load_dir", "load: resolve directory (collective)"),
        (manager, "_verify_sharded_tree", "load: . shard files checked before the read (JAX: xxh3 of this process's "
                                          "share; torch: sizes)"),
        (manager, "_read", "load: _read (manifest, our files, contains the one above)"),
        (manager.sharding, "load_sharded_hashed" if manager.sharding.hashes_while_reading else "load_sharded",
         "load: . the backend's sharded read into new arrays (DCP / Orbax; torch: hashing what it reads whole)"),
        (manager, "_check_read_hashes", "load: . torch: the read's checksums compared, files no process read whole "
                                        "hashed"),
        (manager, "_with_sharded", "load: _with_sharded (contains the two above; decode)"),
        (manager, "_restore_rng", "load: RNG restore"),
    ]
    group.barrier()
    with Phases(save_targets) as phases:
        start = time.perf_counter()
        acc.save_state(directory)
        total_save = time.perf_counter() - start
    result = dict(phases.seconds)
    result["save: total (save_state)"] = total_save
    mutate()
    group.barrier()
    with Phases(load_targets) as phases:
        start = time.perf_counter()
        acc.load_state(directory)
        total_load = time.perf_counter() - start
    check()
    result.update(phases.seconds)
    result["load: total (load_state; set_state of each object is the rest)"] = total_load
    group.clean(directory)
    return result


def finish(group: Group, result: Dict[str, Any]) -> None:
    """Gather every process's result onto process 0, which prints it for the parent."""
    everyone = group.acc.gather_object(result)
    if group.rank == 0:
        _report({"processes": everyone, "rss_method": PeakRSS.method})


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def _layers(args: argparse.Namespace) -> int:
    return max(1, round(args.size_gb * GB / 3 / 4 / (args.hidden * args.hidden + args.hidden)))


def _reference_paths(args: argparse.Namespace, part: str) -> Tuple[str, str, str]:
    base = os.path.join(args.dir, f"{part}_reshard")
    return base, base + "_kernel.npy", base + "_moment.npy"


# -- torch ------------------------------------------------------------------------------------------
def _accelerate_fsdp_refusal() -> str:
    """Why Accelerate's FSDP save cannot be a contender in this process group (Accelerate 1.15 on
    CPU: it ignores the plugin), asked of Accelerate itself; never empty: where Accelerate does
    turn FSDP on, the reason is that this script has no such contender yet."""
    try:
        import accelerate
        from accelerate.utils import DistributedType
        from accelerate.utils import FullyShardedDataParallelPlugin as TheirPlugin
    except ImportError as err:
        return f"accelerate is not installed ({err}); pip install -e '.[bench]'"
    try:
        theirs = accelerate.Accelerator(cpu=True, fsdp_plugin=TheirPlugin(fsdp_version=2,
                                                                           state_dict_type="SHARDED_STATE_DICT"))
    except Exception as err:  # noqa: BLE001 - the reason is the result
        return f"accelerate {accelerate.__version__}: Accelerator(cpu=True, fsdp_plugin=...) raised {err!r}"
    if theirs.distributed_type != DistributedType.FSDP:
        return (f"accelerate {accelerate.__version__} on this {theirs.device.type} process group: "
                      f"Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, "
                      f"state_dict_type='SHARDED_STATE_DICT')) gives distributed_type={theirs.distributed_type.value} "
                      f"and no fsdp_plugin (state.fsdp_plugin: {getattr(theirs.state, 'fsdp_plugin', None)!r}): AcceleratorState turns FSDP on only "
                      "for the MULTI_GPU/NPU/XPU/MLU/SDAA/MUSA/HPU/NEURON distributed types (accelerate/state.py), so "
                      "prepare() would wrap the model in DDP and save_state would not write an FSDP checkpoint")
    return (f"accelerate {accelerate.__version__} turns FSDP on in this process group; this script, written where "
            "it does not (CPU), has no Accelerate contender yet: add one with its own model and optimizer")


def torch_worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import unified

    torch.manual_seed(0)
    hidden, layers = args.hidden, _layers(args)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = unified.FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"])
    acc = unified.Accelerator(fsdp_plugin=plugin)
    model, optimizer = acc.prepare(model, optimizer)
    inner = getattr(optimizer, "optimizer", optimizer)
    group = Group(acc)
    source, kernel_npy, moment_npy = _reference_paths(args, "torch")

    def first() -> Any:
        return next(model.parameters())

    def local_bytes(tensor: Any) -> Tuple[int, int]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size(), tensor.numel() * tensor.element_size()

    def sizes() -> Dict[str, int]:
        tensors = list(model.parameters()) + [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        pairs = [local_bytes(t) for t in tensors]
        return {"own_bytes": sum(p[0] for p in pairs), "state_bytes": sum(p[1] for p in pairs)}

    def mutate() -> None:
        with torch.no_grad():
            first().add_(1.0)
            moment = inner.state.get(first(), {}).get("exp_avg")
            if moment is not None:
                moment.add_(1.0)

    if args.role == "load":  # 2 -> 3: this group has never stepped; the checkpoint's values must arrive
        kernel, moment = np.load(kernel_npy, allow_pickle=False), np.load(moment_npy, allow_pickle=False)

        def check_full() -> None:
            assert np.array_equal(first().detach().full_tensor().numpy(), kernel), "load_state did not restore the parameters"
            assert np.array_equal(inner.state[first()]["exp_avg"].full_tensor().numpy(), moment), \
                "load_state did not restore the optimizer"

        loads = timed_loads(group, lambda: acc.load_state(source), mutate, check_full, args.repeats)
        finish(group, {"reshard_loads": loads, **sizes()})
        return

    # one real step on this process's rows: AdamW's moments exist, sharded like the parameters
    acc.backward(model(torch.randn(4, hidden)).square().mean())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    reference = first().to_local().detach().clone()
    reference_moment = inner.state[first()]["exp_avg"].to_local().detach().clone()

    def check() -> None:
        assert torch.equal(first().to_local(), reference), "load did not restore the parameters"
        assert torch.equal(inner.state[first()]["exp_avg"].to_local(), reference_moment), "load did not restore the optimizer"

    def tensors_only(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
        """The tensor leaves of a state dict under dotted names (the safetensors storage takes
        nothing else)."""
        out: Dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(tensors_only(value, f"{prefix}{key}."))
            elif torch.is_tensor(value):
                out[f"{prefix}{key}"] = value
        return out

    def dcp_save(path: str, hf: bool) -> None:
        model_sd, optim_sd = get_state_dict(model, inner)
        state = {"model": model_sd, "optimizer": optim_sd}
        if hf:
            dcp.save(tensors_only(state), storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))
        else:
            dcp.save(state, checkpoint_id=path)

    def dcp_load(path: str, hf: bool) -> None:
        model_sd, optim_sd = get_state_dict(model, inner)
        state = {"model": model_sd, "optimizer": optim_sd}
        if hf:  # in place into the same tensors as ``state``'s
            dcp.load(tensors_only(state), storage_reader=HuggingFaceStorageReader(path))
        else:
            dcp.load(state, checkpoint_id=path)
        set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def dcp_fsspec(path: str, save: bool) -> None:
        """DCP's fsspec storage on the store's URL (its default format: torch.save shards, a
        pickled .metadata)."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        model_sd, optim_sd = get_state_dict(model, inner)
        state = {"model": model_sd, "optimizer": optim_sd}
        if save:
            dcp.save(state, storage_writer=FsspecWriter(path))
            return
        dcp.load(state, storage_reader=FsspecReader(path))
        set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def own_arrays() -> List[Any]:
        tensors = list(model.parameters()) + [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        return [(t.to_local() if hasattr(t, "to_local") else t).detach().contiguous().numpy() for t in tensors]

    if args.store:
        store_worker(args, group, "torch", {
            "ours": ours_contender(acc),
            "dcp_fsspec": Contender(lambda p: dcp_fsspec(p, True), lambda p: dcp_fsspec(p, False)),
            "raw": raw_store_contender(group.rank, own_arrays),
        }, mutate, check, {**sizes(), "layers": layers, "hidden": hidden,
                           "versions": {"torch": torch.__version__}})
        return

    contenders = {
        "ours": ours_contender(acc),
        "dcp": Contender(lambda p: dcp_save(p, False), lambda p: dcp_load(p, False)),
        "dcp_safetensors": Contender(lambda p: dcp_save(p, True), lambda p: dcp_load(p, True)),
    }
    reason = _accelerate_fsdp_refusal()
    base = os.path.join(args.dir, "torch")
    result: Dict[str, Any] = {"accelerate_skipped": reason, **sizes(), "layers": layers, "hidden": hidden}
    result.update(run_rounds(group, contenders, base, args.repeats, mutate, check))
    result["profile"] = profile_ours(group, os.path.join(base, "profile"), mutate, check)

    # the reshard source, its reference values, and the 2 -> 2 loads of it
    acc.save_state(source)
    full_kernel, full_moment = first().detach().full_tensor().numpy(), inner.state[first()]["exp_avg"].full_tensor().numpy()
    if group.rank == 0:
        np.save(kernel_npy, full_kernel, allow_pickle=False)
        np.save(moment_npy, full_moment, allow_pickle=False)
    result["reshard_loads"] = timed_loads(group, lambda: acc.load_state(source), mutate, check, args.repeats)
    result["versions"] = {"torch": torch.__version__, "accelerate": _version("accelerate")}
    finish(group, result)


def store_worker(args: argparse.Namespace, group: Group, part: str, contenders: Dict[str, Contender],
                 mutate: Callable[[], None], check: Callable[[], None], result: Dict[str, Any]) -> None:
    """``--store``: the rounds under ``<store>/<part>``, no profile and no reshard group."""
    result.update(run_rounds(group, contenders, _join(args.dir, part), args.repeats, mutate, check))
    finish(group, result)


# -- jax --------------------------------------------------------------------------------------------
def jax_worker(args: argparse.Namespace) -> None:
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    import unified

    hidden, layers = args.hidden, _layers(args)

    acc = unified.Accelerator(fsdp_plugin=unified.FullyShardedDataParallelPlugin())
    model = nnx_stack(hidden, layers)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    model, optimizer = acc.prepare(model, optimizer)
    group = Group(acc)
    source, kernel_npy, moment_npy = _reference_paths(args, "jax")

    def leaves(obj: Any) -> List[Any]:
        return jax.tree_util.tree_leaves(nnx.state(obj))

    def sizes() -> Dict[str, int]:
        arrays = leaves(model) + leaves(optimizer)
        own = sum(sum(int(s.data.nbytes) for s in a.addressable_shards) for a in arrays if isinstance(a, jax.Array))
        return {"own_bytes": own, "state_bytes": sum(int(a.nbytes) for a in arrays)}

    big = [i for i, leaf in enumerate(leaves(optimizer)) if leaf.ndim == 2][0]  # the first kernel's first moment

    def mutate() -> None:
        layer = model.layers[0]
        layer.kernel[...] = layer.kernel[...] + 1.0
        state = nnx.state(optimizer)
        flat = jax.tree_util.tree_leaves(state)
        nnx.update(optimizer, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state),
                                                           [x + 1 if i == big else x for i, x in enumerate(flat)]))

    def shards(array: Any) -> List[Tuple[Any, Any]]:
        return [(s.index, np.array(s.data)) for s in array.addressable_shards]

    if args.role == "load":
        kernel, moment = np.load(kernel_npy, allow_pickle=False), np.load(moment_npy, allow_pickle=False)

        def check_full() -> None:
            for index, data in shards(model.layers[0].kernel[...]):
                assert np.array_equal(data, kernel[index]), "load_state did not restore the parameters"
            for index, data in shards(leaves(optimizer)[big]):
                assert np.array_equal(data, moment[index]), "load_state did not restore the optimizer"

        loads = timed_loads(group, lambda: acc.load_state(source), mutate, check_full, args.repeats)
        finish(group, {"reshard_loads": loads, **sizes()})
        return

    batch = NamedSharding(acc.mesh, PartitionSpec("data"))

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)

    step(model, optimizer, jax.make_array_from_process_local_data(batch, np.ones((2, hidden), np.float32)))
    reference = shards(model.layers[0].kernel[...])
    reference_moment = shards(leaves(optimizer)[big])

    def check() -> None:
        for (_, got), (_, want) in zip(shards(model.layers[0].kernel[...]), reference):
            assert np.array_equal(got, want), "load did not restore the parameters"
        for (_, got), (_, want) in zip(shards(leaves(optimizer)[big]), reference_moment):
            assert np.array_equal(got, want), "load did not restore the optimizer"

    def state() -> Dict[str, Any]:
        return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}

    def abstract() -> Any:
        return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state())

    def update(restored: Dict[str, Any]) -> None:
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["optimizer"])

    if args.store:
        def own_arrays() -> List[Any]:
            return [np.asarray(s.data) for a in leaves(model) + leaves(optimizer) if isinstance(a, jax.Array)
                    for s in a.addressable_shards if s.replica_id == 0]

        store_worker(args, group, "jax", {"ours": ours_contender(acc), "raw": raw_store_contender(group.rank, own_arrays)},
                     mutate, check, {**sizes(), "layers": layers, "hidden": hidden, "peer_skipped": (
                         f"orbax-checkpoint {ocp.__version__} cannot write to s3:// (it turns the URL into a local "
                         "path s3:/..., and its commit renames a folder, which S3 cannot do)"),
                         "versions": {"jax": jax.__version__, "flax": flax.__version__}})
        return

    standard = ocp.StandardCheckpointer()  # zstd-compressed chunks by default (ours: uncompressed)
    uncompressed = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))

    def orbax_save(checkpointer: Any, path: str) -> None:
        checkpointer.save(os.path.abspath(path), state())
        checkpointer.wait_until_finished()

    def uncompressed_load(path: str) -> None:
        target = abstract()
        update(uncompressed.restore(os.path.abspath(path), args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))))

    contenders = {
        "ours": ours_contender(acc),
        "orbax": Contender(lambda p: orbax_save(standard, p),
                           lambda p: update(standard.restore(os.path.abspath(p), abstract()))),
        "orbax_uncompressed": Contender(lambda p: orbax_save(uncompressed, p), uncompressed_load),
    }
    base = os.path.join(args.dir, "jax")
    result: Dict[str, Any] = {**sizes(), "layers": layers, "hidden": hidden}
    result.update(run_rounds(group, contenders, base, args.repeats, mutate, check))
    result["profile"] = profile_ours(group, os.path.join(base, "profile"), mutate, check)
    standard.close()
    uncompressed.close()

    acc.save_state(source)
    full_kernel = np.asarray(multihost_utils.process_allgather(model.layers[0].kernel[...], tiled=True))
    full_moment = np.asarray(multihost_utils.process_allgather(leaves(optimizer)[big], tiled=True))
    if group.rank == 0:
        np.save(kernel_npy, full_kernel, allow_pickle=False)
        np.save(moment_npy, full_moment, allow_pickle=False)
    result["reshard_loads"] = timed_loads(group, lambda: acc.load_state(source), mutate, check, args.repeats)
    result["versions"] = {"jax": jax.__version__, "flax": flax.__version__, "orbax-checkpoint": ocp.__version__}
    finish(group, result)


# -- parent: the groups, the tables, the picture -------------------------------------------------------
def per_round(processes: List[Dict[str, Any]], pick: Callable[[Dict[str, Any]], List[Dict[str, float]]]) -> List[float]:
    """A round's time is its slowest process's (the collective ends with it).

    Example:
        >>> per_round([{"x": [{"s": 1.0}, {"s": 3.0}]}, {"x": [{"s": 2.0}, {"s": 2.5}]}], lambda p: p["x"])
        [2.0, 3.0]
    """
    columns = [pick(p) for p in processes]
    return [max(column[i]["s"] for column in columns) for i in range(min(len(c) for c in columns))]


def stats(values: Sequence[float]) -> Dict[str, float]:
    """min / median / max and spread (max / min) of ``values``.

    Example:
        >>> stats([2.0, 1.0, 4.0])
        {'min': 1.0, 'median': 2.0, 'max': 4.0, 'spread': 4.0}
    """
    low, high = min(values), max(values)
    return {"min": low, "median": statistics.median(values), "max": high, "spread": high / low if low > 0 else float("inf")}


def verdict(framework: str, contender: str, ratio: float, store: bool = False) -> str:
    """The goal column of the time table: ours <= 1.1x the raw DCP / Orbax contender, faster than
    Accelerate; on a store (``--store``) ours <= 1.3x the raw transfer, faster than DCP's fsspec
    storage; the rest is information.

    Example:
        >>> verdict("torch", "dcp", 1.05), verdict("jax", "orbax", 1.3), verdict("jax", "orbax_uncompressed", 2.0)
        ('<= 1.1x: yes', '<= 1.1x: NO', '')
        >>> verdict("torch", "raw", 1.25, store=True), verdict("torch", "dcp_fsspec", 0.8, store=True)
        ('<= 1.3x: yes', '< 1x: yes')
    """
    if store:
        if contender in STORE_RAW.get(framework, ()):
            return f"<= {STORE_GOAL:g}x: {'yes' if ratio <= STORE_GOAL else 'NO'}"
        return f"< 1x: {'yes' if ratio < 1 else 'NO'}" if contender in STORE_PEERS else ""
    if contender in RAW.get(framework, ()):
        return f"<= {GOAL:g}x: {'yes' if ratio <= GOAL else 'NO'}"
    if contender == "accelerate":
        return f"< 1x: {'yes' if ratio < 1 else 'NO'}"
    return ""


def time_table(results: Dict[str, Dict[str, Any]], store: bool = False) -> List[str]:
    lines = ["| framework | operation | contender | rounds | min (s) | median (s) | max (s) | spread (max/min) "
             "| ours / this (median) | goal |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for fw, res in results.items():
        procs = res["bench"]["processes"]
        names = list(procs[0]["samples"])
        for op in ("save", "load"):
            ours = statistics.median(per_round(procs, lambda p: p["samples"]["ours"][op]))
            for name in names:
                s = stats(per_round(procs, lambda p, n=name: p["samples"][n][op]))
                ratio = ours / s["median"]
                lines.append(f"| {fw} | {op}_state | {name} | {len(procs[0]['samples'][name][op])} | {s['min']:.3f} | "
                             f"{s['median']:.3f} | {s['max']:.3f} | {s['spread']:.2f}x | {ratio:.2f}x | "
                             f"{verdict(fw, name, ratio, store) if name != 'ours' else ''} |")
    return lines


def memory_table(results: Dict[str, Dict[str, Any]]) -> List[str]:
    """Per process and contender, the worst round: peak RSS during the save against the RSS
    before it and the process's own shard."""
    lines = ["| framework | contender | process | own shard (GB) | whole state (GB) | RSS before save (GB) | peak during "
             "save (GB) | growth (GB) | growth / own shard | peak during load (GB) | load beyond the live state (GB) "
             "| / own shard |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def beyond(x: Dict[str, float]) -> float:  # the live state: the larger of before and after
        return x["rss_peak"] - max(x["rss_before"], x.get("rss_after", 0.0))

    for fw, res in results.items():
        procs = res["bench"]["processes"]
        for name in procs[0]["samples"]:
            for rank, p in enumerate(procs):
                saves, loads = p["samples"][name]["save"], p["samples"][name]["load"]
                worst = max(saves, key=lambda x: x["rss_peak"] - x["rss_before"])
                worst_load = max(loads, key=beyond)
                own = p["own_bytes"]
                growth, load_growth = worst["rss_peak"] - worst["rss_before"], beyond(worst_load)
                lines.append(f"| {fw} | {name} | {rank} | {own / GB:.3f} | {p['state_bytes'] / GB:.3f} | "
                             f"{worst['rss_before'] / GB:.3f} | {worst['rss_peak'] / GB:.3f} | {growth / GB:.3f} | "
                             f"{growth / own:.2f} | {worst_load['rss_peak'] / GB:.3f} | {load_growth / GB:.3f} | "
                             f"{load_growth / own:.2f} |")
    return lines


def reshard_table(results: Dict[str, Dict[str, Any]]) -> List[str]:
    lines = ["| framework | load_state of the 2-process checkpoint | rounds | min (s) | median (s) | max (s) "
             "| spread | / 2 -> 2 (median) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for fw, res in results.items():
        if "load3" not in res:
            continue
        two = stats(per_round(res["bench"]["processes"], lambda p: p["reshard_loads"]))
        for label, s in (("2 -> 2 (ours)", two),
                         ("2 -> 3 (ours)", stats(per_round(res["load3"]["processes"], lambda p: p["reshard_loads"])))):
            lines.append(f"| {fw} | {label} | {len(res['bench']['processes'][0]['reshard_loads'])} | {s['min']:.3f} | "
                         f"{s['median']:.3f} | {s['max']:.3f} | {s['spread']:.2f}x | {s['median'] / two['median']:.2f}x |")
    return lines


def profile_table(results: Dict[str, Dict[str, Any]]) -> List[str]:
    lines = []
    for fw, res in results.items():
        procs = res["bench"]["processes"]
        if "profile" not in procs[0]:  # --store
            continue
        phases = list(dict.fromkeys(k for p in procs for k in p["profile"]))
        lines += [f"\n{fw}: one save_state + load_state of ours, phase by phase (s; '.' marks a phase inside the "
                  "next unmarked one)", "| phase | " + " | ".join(f"process {r}" for r in range(len(procs))) + " |",
                  "|---|" + "---:|" * len(procs)]
        for phase in phases:
            lines.append(f"| {phase} | " + " | ".join(f"{p['profile'].get(phase, 0.0):.3f}" for p in procs) + " |")
    return lines


def picture(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, List[float]]]:
    """``group -> contender -> samples`` for `plot.draw`."""
    rows: Dict[str, Dict[str, List[float]]] = {}
    for fw, res in results.items():
        procs = res["bench"]["processes"]
        for op in ("save", "load"):
            rows[f"{fw} {op}"] = {n: per_round(procs, lambda p, n=n: p["samples"][n][op]) for n in procs[0]["samples"]}
        if "load3" in res:
            rows[f"{fw} load 2->2 | 2->3"] = {  # ours in its own colour: the 2 -> 2 load
                "ours": per_round(procs, lambda p: p["reshard_loads"]),
                "ours 2->3": per_round(res["load3"]["processes"], lambda p: p["reshard_loads"])}
    return rows


def report(results: Dict[str, Dict[str, Any]], store: bool = False) -> str:
    out = ["Time per call (a round's time is its slowest process's)", *time_table(results, store)]
    for fw, res in results.items():
        first = res["bench"]["processes"][0]
        reason = first.get("accelerate_skipped")
        if reason:
            out.append(f"\n{fw}: no Accelerate column: {reason}")
        if first.get("peer_skipped"):
            out.append(f"\n{fw}: no peer column: {first['peer_skipped']}")
        out.append(f"\n{fw}: {first['layers']} x Linear({first['hidden']}, {first['hidden']}), whole state "
                   f"{first['state_bytes'] / GB:.3f} GB on 2 processes; versions {first['versions']}")
        out.append("| contender | files | bytes on disk (apparent) | allocated |")
        out.append("|---|---:|---:|---:|")
        for name, d in first["disk"].items():
            out.append(f"| {name} | {d['files']} | {d['apparent']:,} | {d['allocated']:,} |")
    method = next(iter(results.values()))["bench"]["rss_method"]
    out += [f"\nPeak RSS per process ({method}; worst round of each contender)", *memory_table(results)]
    if not store:
        out += ["\nReshard: ours, the same 2-process checkpoint loaded by 2 and by 3 processes (one warm-up load each, "
                "then the rounds)", *reshard_table(results)]
    out += profile_table(results)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.5, help="model + optimizer state per framework (GB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="torch,jax")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a new temporary directory)")
    parser.add_argument("--hidden", type=int, default=2304, help="width of each Linear layer (2 and 3 should divide it)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds each process group may take")
    parser.add_argument("--picture", default=str(PICTURE), help="where the PNG goes ('' for none)")
    parser.add_argument("--store", action="store_true",
                        help="to moto's S3 server on loopback instead of a folder (issue 29; needs moto[server])")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=["torch", "jax"], help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["bench", "load"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    if args.worker:
        (torch_worker if args.part == "torch" else jax_worker)(args)
        return

    server = None
    if args.store:
        from store_checkpoint import _start_server

        server, endpoint = _start_server()
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1")
        import fsspec

        bucket = f"bench-sharded-{int(time.time())}"
        fsspec.filesystem("s3").mkdir(bucket)
        own_dir, directory = False, f"s3://{bucket}/sharded"
        if args.picture == str(PICTURE):
            args.picture = str(STORE_PICTURE)
    else:
        own_dir = args.dir is None
        directory = tempfile.mkdtemp(prefix="unified-sharded-bench-") if own_dir else os.path.abspath(args.dir)
        os.makedirs(directory, exist_ok=True)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    results: Dict[str, Dict[str, Any]] = {}
    try:
        for part in [p.strip() for p in args.parts.split(",") if p.strip()]:
            common = ["--part", part, "--size-gb", str(args.size_gb), "--repeats", str(args.repeats),
                      "--dir", directory, "--hidden", str(args.hidden)] + (["--store"] if args.store else [])
            _log(f"== {part}: 2 processes, every contender ==")
            bench = run_launched(__file__, part, common + ["--role", "bench"], args.timeout, processes=2)
            if bench is None:
                sys.exit(f"{part}: the 2-process group gave no result (its output is above)")
            results[part] = {"bench": bench}
            if args.store:
                continue
            _log(f"== {part}: 3 processes load the 2-process checkpoint ==")
            load3 = run_launched(__file__, part, common + ["--role", "load"], args.timeout, processes=3)
            if load3 is None:
                sys.exit(f"{part}: the 3-process group gave no result (its output is above)")
            results[part]["load3"] = load3
            source, kernel_npy, moment_npy = _reference_paths(argparse.Namespace(dir=directory), part)
            _clean(source)
            for path in (kernel_npy, moment_npy):
                if os.path.exists(path):
                    os.remove(path)
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
        if server is not None:
            server.kill()
            server.wait()
    print(f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"--size-gb {args.size_gb} --repeats {args.repeats} --hidden {args.hidden}; wall time "
          f"{time.perf_counter() - started:.0f} s; 1-min load average at start {load_start:.2f}, at end "
          f"{os.getloadavg()[0]:.2f} (other processes on this machine disturb the timings)\n")
    print(report(results, args.store))
    if args.picture:
        from plot import as_samples, draw

        where = " to S3 (moto, loopback)" if args.store else ""
        draw(args.picture, f"sharded save_state / load_state{where}, 2 processes, {args.size_gb:g} GB of state", "s",
             as_samples(picture(results)))


if __name__ == "__main__":
    main()
