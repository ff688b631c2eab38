"""Sharded ``save_state`` / ``load_state`` on 2 processes against raw ``torch.distributed.checkpoint``
(torch, FSDP2) and raw Orbax (JAX), peak RSS per process during a save, and the reshard cost.

Run from the repository root:

    python -m benchmarks.sharded_checkpoint [--size-gb 1.5] [--repeats 3] [--parts torch,jax]
                                            [--dir DIR] [--hidden 2304]

For each part the script launches itself twice with ``python -m unified launch``: a group of 2
processes (every contender, then our reshard source) and a group of 3 (our load of that 2-process
checkpoint). Loopback only. Process 0 of each group prints one JSON line with every process's
samples; the parent prints markdown tables and draws docs/benchmarks/img/sharded_checkpoint.png
(`benchmarks.plot`).

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

Fairness (as benchmarks/checkpoint.py, `checkpointing.path_rounds`): one untimed warm-up round of
every contender, then ``--repeats`` rounds in rotated order, Python's garbage collected before
every timing; each contender's save is followed by its load; then process 0 deletes its directory,
calls ``os.sync()`` and waits for ``Dirty:`` in /proc/meminfo to fall (outside the timings). Every
process starts each timed call together (a barrier first) and times its own call; a round's sample
is the slowest process's time (the collective ends with it). Every load is checked: a parameter
and an optimizer moment are changed after the save and must come back.

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
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any, Callable, Dict, List, Tuple

from benchmarks import plot
from benchmarks.checkpointing import (
    Phases,
    bucket,
    clean,
    contender,
    dcp_contender,
    jax_leaves,
    jax_objects,
    jax_probe,
    join,
    orbax_contenders,
    path_rounds,
    raw_limit,
    remove,
    s3_server,
    stored_bytes,
    torch_objects,
    torch_probe,
    torch_tensors,
)
from benchmarks.runner import (
    GB,
    PeakMemory,
    Run,
    beyond,
    cells,
    emit,
    interleaved,
    log,
    measured,
    print_command,
    run_launched,
    table,
)

PICTURE = str(plot.image("sharded_checkpoint"))
STORE_PICTURE = str(plot.image("sharded_store_checkpoint"))
GOAL = 1.1  # from issue 13: ours no slower than raw DCP / Orbax, <= 1.1x
# the raw contenders the goal is measured against; the others are for information
RAW = {"torch": ("dcp", "dcp_safetensors"), "jax": ("orbax",)}
STORE_GOAL = 1.3  # issue 29: on a store, ours within 1.3x the raw transfer...
STORE_RAW = {"torch": ("raw",), "jax": ("raw",)}
STORE_PEERS = ("dcp_fsspec",)  # ...and ahead of these


# -- what every worker does ---------------------------------------------------------------------------
class Group:
    """The worker's view of its process group: barriers through our Accelerator, timed calls that
    every process starts together, rounds whose paths process 0 removes while the others wait."""

    def __init__(self, accelerator: Any) -> None:
        self.acc = accelerator
        self.rank = accelerator.process_index
        self.options = {"names": ("save", "load"), "clock": self.timed}  # of `checkpointing.contender`

    def barrier(self) -> None:
        self.acc.wait_for_everyone()

    def clean(self, path: str) -> None:
        self.barrier()
        if self.rank == 0:
            remove(path)
        self.barrier()

    def timed(self, fn: Callable[[], Any]) -> Dict[str, float]:
        """``fn`` started together on every process: this process's seconds and RSS alone (no
        sampler beside the timed call; `runner.measured`), the C heap's free memory handed back
        first (untimed), or memory an earlier round freed would be reused unseen."""
        return measured(fn, self.barrier, trim=True)

    def size(self, path: str) -> Any:
        self.barrier()
        return stored_bytes(path) if self.rank == 0 else None

    def rounds(self, contenders: Dict[str, Callable[..., Any]], base: str, repeats: int) -> Dict[str, Any]:
        """`path_rounds`: warm-up, then ``repeats`` rounds in rotated order of save, mutate, load,
        check, clean; sizes on disk on process 0."""
        return path_rounds(contenders, base, repeats, cleanup=self.clean, size=self.size,
                           say=log if self.rank == 0 else None,
                           describe=lambda got: f"save {got['save']['s']:.3f}s, load {got['load']['s']:.3f}s "
                                                "(process 0)")

    def loads(self, load: Callable[[], None], mutate: Callable[[], None], check: Callable[[], None],
              repeats: int) -> List[Dict[str, float]]:
        """One warm-up load, then ``repeats`` timed ones, each after ``mutate`` and checked."""
        def once() -> Dict[str, float]:
            mutate()
            got = self.timed(load)
            check()
            return got

        return interleaved({"load": once}, repeats)["load"]

    def finish(self, result: Dict[str, Any]) -> None:
        """Gather every process's result onto process 0, which prints it for the parent."""
        everyone = self.acc.gather_object(result)
        if self.rank == 0:
            emit({"processes": everyone, "rss_method": PeakMemory.method})


def profile_ours(group: Group, directory: str, probe: Any) -> Dict[str, float]:
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
        (manager.sharding, "load_sharded",
         "load: . the backend's sharded read into new arrays (DCP / Orbax; torch: hashing what it reads whole)"),
        (manager, "_check_read_hashes", "load: . torch: the read's checksums compared, files no process read whole "
                                        "hashed"),
        (manager, "_with_sharded", "load: _with_sharded (contains the two above; decode)"),
        (manager, "_restore_rng", "load: RNG restore"),
    ]
    phases = Phases()
    group.barrier()
    with phases.timing(save_targets):
        phases.run("save: total (save_state)", acc.save_state, directory)
    probe.mutate()
    group.barrier()
    with phases.timing(load_targets):
        phases.run("load: total (load_state; set_state of each object is the rest)", acc.load_state, directory)
    probe.check()
    group.clean(directory)
    return phases.seconds


def bench(args: argparse.Namespace, group: Group, part: str, contenders: Dict[str, Callable[..., Any]], probe: Any,
          result: Dict[str, Any], full: Callable[[], List[Any]], close: Callable[[], Any] = lambda: None) -> None:
    """The rounds (``--store``: only they); then the profile of ours, the reshard source, its
    reference values (``full()``, collective: the whole first kernel and its first moment, which
    process 0 writes as .npy) and the 2 -> 2 loads of it."""
    import numpy as np

    base = join(args.dir, part)
    result.update(group.rounds(contenders, base, args.repeats))
    if not args.store:
        result["profile"] = profile_ours(group, os.path.join(base, "profile"), probe)
        close()
        source, kernel_npy, moment_npy = _reference_paths(args, part)
        group.acc.save_state(source)
        arrays = full()
        if group.rank == 0:
            for path, array in zip((kernel_npy, moment_npy), arrays):
                np.save(path, array, allow_pickle=False)
        result["reshard_loads"] = group.loads(lambda: group.acc.load_state(source), probe.mutate, probe.check,
                                              args.repeats)
    group.finish(result)


def reshard_loads(args: argparse.Namespace, group: Group, probe: Any, matches: Callable[[Any, Any], bool],
                  sizes: Dict[str, int]) -> None:
    """``--role load``: this group (3 processes, never stepped) loads the 2-process checkpoint;
    ``matches(array, full)`` checks this process's part of an array against the saved whole."""
    import numpy as np

    source, *references = _reference_paths(args, args.part)
    full = [np.load(path, allow_pickle=False) for path in references]

    def check() -> None:
        for what, array, whole in zip(("parameters", "optimizer"), probe.arrays(), full):
            assert matches(array, whole), f"load_state did not restore the {what}"

    group.finish({"reshard_loads": group.loads(lambda: group.acc.load_state(source), probe.mutate, check, args.repeats),
                  **sizes})


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


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
                f"and no fsdp_plugin (state.fsdp_plugin: {getattr(theirs.state, 'fsdp_plugin', None)!r}): "
                "AcceleratorState turns FSDP on only "
                "for the MULTI_GPU/NPU/XPU/MLU/SDAA/MUSA/HPU/NEURON distributed types (accelerate/state.py), so "
                "prepare() would wrap the model in DDP and save_state would not write an FSDP checkpoint")
    return (f"accelerate {accelerate.__version__} turns FSDP on in this process group; this script, written where "
            "it does not (CPU), has no Accelerate contender yet: add one with its own model and optimizer")


def torch_worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    import unified

    model, optimizer, layers = torch_objects(args.size_gb, args.hidden, step=False)
    plugin = unified.FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"])
    acc = unified.Accelerator(fsdp_plugin=plugin)
    model, optimizer = acc.prepare(model, optimizer)
    inner = getattr(optimizer, "optimizer", optimizer)
    group = Group(acc)

    def sizes() -> Dict[str, int]:
        tensors = torch_tensors(model, inner)
        own = [(t.to_local() if hasattr(t, "to_local") else t) for t in tensors]
        return {"own_bytes": sum(t.numel() * t.element_size() for t in own),
                "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}

    if args.role == "load":  # 2 -> 3: this group has never stepped; the checkpoint's values must arrive
        return reshard_loads(args, group, torch_probe(model, inner),
                             lambda tensor, whole: np.array_equal(tensor.detach().full_tensor().numpy(), whole),
                             sizes())

    # one real step on this process's rows: AdamW's moments exist, sharded like the parameters
    acc.backward(model(torch.randn(4, args.hidden)).square().mean())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    probe, options = torch_probe(model, inner), group.options

    def own_arrays() -> Dict[str, List[Any]]:
        return {f"raw-{group.rank}.bin": [(t.to_local() if hasattr(t, "to_local") else t).detach().contiguous().numpy()
                                          for t in torch_tensors(model, inner)]}

    result: Dict[str, Any] = {**sizes(), "layers": layers, "hidden": args.hidden}
    contenders = {"ours": contender(acc.save_state, acc.load_state, probe, **options)}
    if args.store:
        contenders.update(dcp_fsspec=dcp_contender(model, inner, probe, storage="fsspec", **options),
                          raw=raw_limit(own_arrays, **options))
        result["versions"] = {"torch": torch.__version__}
    else:
        contenders.update(dcp=dcp_contender(model, inner, probe, **options),
                          dcp_safetensors=dcp_contender(model, inner, probe, storage="safetensors", **options))
        result.update(accelerate_skipped=_accelerate_fsdp_refusal(),
                      versions={"torch": torch.__version__, "accelerate": _version("accelerate")})
    bench(args, group, "torch", contenders, probe, result,
          lambda: [tensor.detach().full_tensor().numpy() for tensor in probe.arrays()])


# -- jax --------------------------------------------------------------------------------------------
def jax_worker(args: argparse.Namespace) -> None:
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    import unified

    acc = unified.Accelerator(fsdp_plugin=unified.FullyShardedDataParallelPlugin())  # before any array
    model, optimizer, layers = jax_objects(args.size_gb, args.hidden, step=False)
    model, optimizer = acc.prepare(model, optimizer)
    group = Group(acc)

    def sizes() -> Dict[str, int]:
        arrays = jax_leaves(model) + jax_leaves(optimizer)
        own = sum(sum(int(s.data.nbytes) for s in a.addressable_shards) for a in arrays if isinstance(a, jax.Array))
        return {"own_bytes": own, "state_bytes": sum(int(a.nbytes) for a in arrays)}

    if args.role == "load":
        return reshard_loads(args, group, jax_probe(model, optimizer), lambda array, whole: all(
            np.array_equal(np.array(s.data), whole[s.index]) for s in array.addressable_shards), sizes())

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)

    batch = NamedSharding(acc.mesh, PartitionSpec("data"))
    step(model, optimizer, jax.make_array_from_process_local_data(batch, np.ones((2, args.hidden), np.float32)))
    probe, options = jax_probe(model, optimizer), group.options
    result: Dict[str, Any] = {**sizes(), "layers": layers, "hidden": args.hidden}
    contenders, close = {"ours": contender(acc.save_state, acc.load_state, probe, **options)}, (lambda: None)
    if args.store:
        contenders["raw"] = raw_limit(lambda: {f"raw-{group.rank}.bin": [
            np.asarray(s.data) for a in jax_leaves(model) + jax_leaves(optimizer) if isinstance(a, jax.Array)
            for s in a.addressable_shards if s.replica_id == 0]}, **options)
        result.update(peer_skipped=f"orbax-checkpoint {ocp.__version__} cannot write to s3:// (it turns the URL into "
                                   "a local path s3:/..., and its commit renames a folder, which S3 cannot do)",
                      versions={"jax": jax.__version__, "flax": flax.__version__})
    else:
        orbax, close = orbax_contenders({"model": model, "optimizer": optimizer}, probe, **options)
        contenders.update(orbax)
        result["versions"] = {"jax": jax.__version__, "flax": flax.__version__, "orbax-checkpoint": ocp.__version__}
    bench(args, group, "jax", contenders, probe, result,
          lambda: [np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in probe.arrays()], close)


# -- parent: the groups, the tables, the picture -------------------------------------------------------
def per_round(processes: List[Dict[str, Any]], pick: Callable[[Dict[str, Any]], List[Dict[str, float]]]) -> List[float]:
    """A round's time is its slowest process's (the collective ends with it).

    Example:
        >>> per_round([{"x": [{"s": 1.0}, {"s": 3.0}]}, {"x": [{"s": 2.0}, {"s": 2.5}]}], lambda p: p["x"])
        [2.0, 3.0]
    """
    columns = [pick(p) for p in processes]
    return [max(column[i]["s"] for column in columns) for i in range(min(len(c) for c in columns))]


def samples_of(processes: List[Dict[str, Any]], contender: str, op: str) -> List[float]:
    """`per_round` of one contender's ``op`` ("save" or "load")."""
    return per_round(processes, lambda p: p["samples"][contender][op])


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
    rows = []
    for fw, res in results.items():
        procs = res["bench"]["processes"]
        for op in ("save", "load"):
            ours = statistics.median(samples_of(procs, "ours", op))
            for name in procs[0]["samples"]:
                values = samples_of(procs, name, op)
                ratio = ours / statistics.median(values)
                rows.append([fw, f"{op}_state", name, len(procs[0]["samples"][name][op]),
                             *cells(values, "min median max spread", spread_digits=2), f"{ratio:.2f}x",
                             verdict(fw, name, ratio, store) if name != "ours" else ""])
    return table(["framework", "operation", "contender", "rounds", "min (s)", "median (s)", "max (s)",
                  "spread (max/min)", "ours / this (median)", "goal"], "lllrrrrrrl", rows).splitlines()


def memory_table(results: Dict[str, Dict[str, Any]]) -> List[str]:
    """Per process and contender, the worst round: peak RSS during the save against the RSS
    before it and the process's own shard; the load's peak beyond the live state (`runner.beyond`)."""
    rows = []
    for fw, res in results.items():
        procs = res["bench"]["processes"]
        for name in procs[0]["samples"]:
            for rank, p in enumerate(procs):
                save = max(p["samples"][name]["save"], key=lambda x: x["rss_peak"] - x["rss_before"])
                load = max(p["samples"][name]["load"], key=beyond)
                own, growth, load_growth = p["own_bytes"], save["rss_peak"] - save["rss_before"], beyond(load)
                rows.append([fw, name, rank, *(f"{x / GB:.3f}" for x in (own, p["state_bytes"], save["rss_before"],
                                                                          save["rss_peak"], growth)),
                             f"{growth / own:.2f}", f"{load['rss_peak'] / GB:.3f}", f"{load_growth / GB:.3f}",
                             f"{load_growth / own:.2f}"])
    return table(["framework", "contender", "process", "own shard (GB)", "whole state (GB)", "RSS before save (GB)",
                  "peak during save (GB)", "growth (GB)", "growth / own shard", "peak during load (GB)",
                  "load beyond the live state (GB)", "/ own shard"], "llrrrrrrrrrr", rows).splitlines()


def reshard_table(results: Dict[str, Dict[str, Any]]) -> List[str]:
    rows = []
    for fw, res in results.items():
        if "load3" not in res:
            continue
        two = per_round(res["bench"]["processes"], lambda p: p["reshard_loads"])
        for label, values in (("2 -> 2 (ours)", two), ("2 -> 3 (ours)", per_round(res["load3"]["processes"],
                                                                                   lambda p: p["reshard_loads"]))):
            rows.append([fw, label, len(res["bench"]["processes"][0]["reshard_loads"]),
                         *cells(values, "min median max spread ratio", statistics.median(two), spread_digits=2,
                                ratio_digits=2)])
    return table(["framework", "load_state of the 2-process checkpoint", "rounds", "min (s)", "median (s)", "max (s)",
                  "spread", "/ 2 -> 2 (median)"], "llrrrrrr", rows).splitlines()


def profile_table(results: Dict[str, Dict[str, Any]]) -> List[str]:
    lines = []
    for fw, res in results.items():
        procs = res["bench"]["processes"]
        if "profile" not in procs[0]:  # --store
            continue
        phases = list(dict.fromkeys(k for p in procs for k in p["profile"]))
        lines += [f"\n{fw}: one save_state + load_state of ours, phase by phase (s; '.' marks a phase inside the "
                  "next unmarked one)", *table(["phase", *(f"process {r}" for r in range(len(procs)))],
                                               "l" + "r" * len(procs),
                                               [[phase, *(f"{p['profile'].get(phase, 0.0):.3f}" for p in procs)]
                                                for phase in phases]).splitlines()]
    return lines


def picture(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, List[float]]]:
    """``group -> contender -> samples`` for `plot.draw`."""
    rows: Dict[str, Dict[str, List[float]]] = {}
    for fw, res in results.items():
        procs = res["bench"]["processes"]
        for op in ("save", "load"):
            rows[f"{fw} {op}"] = {n: samples_of(procs, n, op) for n in procs[0]["samples"]}
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
        out += table(["contender", "files", "bytes on disk (apparent)", "allocated"], "lrrr",
                     [[name, d["files"], f"{d['apparent']:,}", f"{d['allocated']:,}"]
                      for name, d in first["disk"].items()]).splitlines()
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
    parser.add_argument("--dir", default=None,
                        help="where checkpoints are written (default: a new temporary directory)")
    parser.add_argument("--hidden", type=int, default=2304,
                        help="width of each Linear layer (2 and 3 should divide it)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds each process group may take")
    parser.add_argument("--picture", default=PICTURE, help="where the PNG goes ('' for none)")
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
    print_command()
    run, results = Run(), {}
    with s3_server() if args.store else contextlib.nullcontext():
        if args.store:
            own_dir, directory = False, f"{bucket('bench-sharded')}/sharded"
            args.picture = STORE_PICTURE if args.picture == PICTURE else args.picture
        else:
            own_dir = args.dir is None
            directory = tempfile.mkdtemp(prefix="unified-sharded-bench-") if own_dir else os.path.abspath(args.dir)
            os.makedirs(directory, exist_ok=True)
        try:
            for part in [p.strip() for p in args.parts.split(",") if p.strip()]:
                common = ["--part", part, "--size-gb", str(args.size_gb), "--repeats", str(args.repeats),
                          "--dir", directory, "--hidden", str(args.hidden)] + (["--store"] if args.store else [])
                for role, processes in (("bench", 2),) + ((("load", 3),) if not args.store else ()):
                    log(f"== {part}: {processes} processes, " + ("every contender ==" if role == "bench" else
                                                                 "load the 2-process checkpoint =="))
                    got = run_launched(__file__, part, common + ["--role", role], args.timeout, processes=processes)
                    if got is None:
                        sys.exit(f"{part}: the {processes}-process group gave no result (its output is above)")
                    results.setdefault(part, {})["bench" if role == "bench" else "load3"] = got
                if not args.store:
                    source, *references = _reference_paths(argparse.Namespace(dir=directory), part)
                    clean(source)
                    for path in references:
                        if os.path.exists(path):
                            os.remove(path)
        finally:
            if own_dir:
                shutil.rmtree(directory, ignore_errors=True)
    print(run.machine(f"--size-gb {args.size_gb} --repeats {args.repeats} --hidden {args.hidden}"))
    print(report(results, args.store))
    if args.picture:
        where = " to S3 (moto, loopback)" if args.store else ""
        plot.draw(args.picture, f"sharded save_state / load_state{where}, 2 processes, {args.size_gb:g} GB of state",
                  "s", plot.as_samples(picture(results)))


if __name__ == "__main__":
    main()
