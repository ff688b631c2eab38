"""What the checkpoint benchmarks share (checkpoint.py, store_checkpoint.py, sharded_checkpoint.py,
gpu_check.py): the state they save (square Linear layers and AdamW, torch or JAX), the change
every load must undo (`torch_probe`, `jax_probe`), rounds of saves and loads on paths of their
own (`path_rounds`, `round_trip`), the raw limit's writes and reads, the clean-up between
contenders, and moto's S3 server on loopback (`s3_server`).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import socket
import subprocess
import sys
import time
import types
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from benchmarks.runner import GB, clocked, columns, interleaved, log, measured, timed

MEMORY_RSS = "peak RSS beyond the live state"  # the keys `round_trip` adds in its memory round (bytes)
MEMORY_ANON = "peak anonymous memory beyond the live state"
PART_BYTES = 32 << 20  # the raw limit's multipart upload and download on a store, as ours
_MISSING = object()


# -- the state ----------------------------------------------------------------------------------------
def layer_count(size_gb: float, hidden: int) -> int:
    """Linear(hidden, hidden) layers (float32 weights and biases) holding ``size_gb / 3`` GB: with
    AdamW's two moments, about ``size_gb`` of state."""
    return max(1, round(size_gb * GB / 3 / 4 / (hidden * hidden + hidden)))


def torch_objects(size_gb: float, hidden: int, step: bool = True) -> Tuple[Any, Any, int]:
    """The torch model (seeded with 0) and AdamW optimizer of `layer_count` layers, after one step
    (its moments exist) or before any (as a resuming script builds them); and the layer count."""
    import torch

    torch.manual_seed(0)
    layers = layer_count(size_gb, hidden)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        model(torch.randn(4, hidden)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, layers


def torch_tensors(model: Any, optimizer: Any) -> List[Any]:
    """Every tensor of the state: the parameters, then the optimizer's (its step counts included)."""
    import torch

    return list(model.parameters()) + [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def torch_arrays(model: Any, optimizer: Any) -> Dict[str, List[Any]]:
    """The live state's own memory per file of the raw limit: NumPy views, no copy."""
    import torch

    return {"model": [p.detach().numpy() for p in model.parameters()],
            "optimizer": [t.detach().numpy() for s in optimizer.state.values() for t in s.values()
                          if torch.is_tensor(t) and t.dim() > 0]}


def torch_probe(model: Any, optimizer: Any = None) -> types.SimpleNamespace:
    """The first parameter and its first moment (``arrays()``; the moment None before a step or
    without an optimizer):
    ``mutate()`` adds 1 to both after a save, ``check()`` asserts that the load brought back this
    process's part of both (a DTensor's local shard)."""
    import torch

    def arrays() -> List[Any]:
        first = next(model.parameters())  # load_state_dict copies into the same Parameter objects
        return [first, optimizer.state.get(first, {}).get("exp_avg") if optimizer is not None else None]

    def own(tensor: Any) -> Any:
        return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach()

    saved = [own(t).clone() for t in arrays() if t is not None]

    def mutate() -> None:
        with torch.no_grad():
            for tensor in arrays():
                if tensor is not None:
                    tensor.add_(1.0)

    def check() -> None:
        for what, tensor, want in zip(("parameters", "optimizer"), arrays(), saved):
            assert torch.equal(own(tensor), want), f"the load did not restore the {what}"

    return types.SimpleNamespace(arrays=arrays, mutate=mutate, check=check)


def nnx_stack(hidden: int, layers: int) -> Any:
    """``layers`` x ``nnx.Linear(hidden, hidden)`` applied in turn, seeded with 0."""
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([nnx.Linear(hidden, hidden, rngs=rngs) for _ in range(layers)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Stack(nnx.Rngs(0))


def jax_objects(size_gb: float, hidden: int, step: bool = True) -> Tuple[Any, Any, int]:
    """`nnx_stack` of `layer_count` layers and ``nnx.Optimizer(model, optax.adamw(1e-3))``, after
    one update or before any; and the layer count."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    layers = layer_count(size_gb, hidden)
    model = nnx_stack(hidden, layers)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    if step:
        x = jnp.ones((4, hidden), jnp.float32)
        optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
    return model, optimizer, layers


def jax_leaves(obj: Any) -> List[Any]:
    """The arrays of an NNX object's state."""
    import jax
    from flax import nnx

    return jax.tree_util.tree_leaves(nnx.state(obj))


def jax_arrays(model: Any, optimizer: Any) -> Dict[str, List[Any]]:
    """The live state's memory per file of the raw limit (NumPy views of the arrays)."""
    import numpy as np

    return {name: [np.asarray(leaf) for leaf in jax_leaves(obj) if leaf.ndim > 0]
            for name, obj in (("model", model), ("optimizer", optimizer))}


def jax_probe(model: Any, optimizer: Any = None) -> types.SimpleNamespace:
    """`torch_probe` for `nnx_stack`: the first kernel and its first moment (with an optimizer),
    compared on the shards this process holds."""
    import jax
    import numpy as np
    from flax import nnx

    big = [i for i, leaf in enumerate(jax_leaves(optimizer)) if leaf.ndim == 2][0] if optimizer is not None else None

    def arrays() -> List[Any]:  # the first kernel, and its first moment
        return [model.layers[0].kernel[...]] + ([jax_leaves(optimizer)[big]] if optimizer is not None else [])

    def own(array: Any) -> List[Any]:
        return [np.array(shard.data) for shard in array.addressable_shards]

    saved = [own(a) for a in arrays()]

    def mutate() -> None:
        layer = model.layers[0]
        layer.kernel[...] = layer.kernel[...] + 1.0
        if optimizer is None:
            return
        state = nnx.state(optimizer)
        flat = jax.tree_util.tree_leaves(state)
        nnx.update(optimizer, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state),
                                                           [x + 1 if i == big else x for i, x in enumerate(flat)]))

    def check() -> None:
        for what, array, want in zip(("parameters", "optimizer"), arrays(), saved):
            assert all(np.array_equal(a, b) for a, b in zip(own(array), want)), f"the load did not restore the {what}"

    return types.SimpleNamespace(arrays=arrays, mutate=mutate, check=check)


# -- rounds of saves and loads ----------------------------------------------------------------------------
def round_trip(save: Callable[[], Any], load: Callable[[], Any], probe: Any = None, *, memory: bool = False,
               names: Sequence[str] = ("save_state", "load_state"), clock: Callable[[Callable[[], Any]], Any] = timed
               ) -> Dict[str, Any]:
    """A save timed (``clock``), the live state changed (``probe.mutate``), the load timed, and
    checked (``probe.check``): ``{names[0]: ..., names[1]: ...}``.

    ``memory``: instead of the times, each call's peak memory beyond what the process held before
    it (`MEMORY_RSS`, `MEMORY_ANON`; bytes), after the C heap's free memory went back to the
    kernel: without that a contender reuses, unseen, memory another one's call freed. That
    hand-back makes the call's allocations take fresh pages, which costs time (a torch load of
    1.5 GB: 2.2 s against 0.3 s measured side by side), so this is a round of its own, untimed."""
    out: Dict[str, Any] = {}
    for name, call in zip(names, (save, load)):
        if call is load and probe is not None:
            probe.mutate()
        if memory:
            got = measured(call, trim=True, anonymous=True)
            out[f"{name} {MEMORY_RSS}"] = float(got["rss_peak"] - got["rss_before"])
            out[f"{name} {MEMORY_ANON}"] = float(got["anon_peak"] - got["anon_before"])
        else:
            out[name] = clock(call)
    if probe is not None:
        probe.check()
    return out


def contender(save: Callable[[str], Any], load: Callable[[str], Any], probe: Any = None, **options: Any
              ) -> Callable[..., Dict[str, Any]]:
    """A contender of `path_rounds`: ``save(path)`` then ``load(path)`` in a `round_trip`."""
    def run(path: str, memory: bool = False) -> Dict[str, Any]:
        return round_trip(lambda: save(path), lambda: load(path), probe, memory=memory, **options)

    return run


def orbax_contenders(objects: Mapping[str, Any], probe: Any = None, **options: Any
                     ) -> Tuple[Dict[str, Callable[..., Any]], Callable[[], None]]:
    """Orbax as `contender`s of the state of NNX ``objects`` (``{"model": nnx.state(model), ...}``):
    ``orbax`` (``StandardCheckpointer``: its default compresses every chunk with zstd level 3)
    and ``orbax_uncompressed`` (``PyTreeCheckpointHandler(use_compression=False)``: the bytes ours
    writes). A save waits until finished; a restore takes the abstract tree (shapes, dtypes,
    shardings), then ``nnx.update`` of every object (what our load does in place). And a close."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    standard = ocp.StandardCheckpointer()
    uncompressed = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))

    def state() -> Dict[str, Any]:
        return {name: nnx.state(obj) for name, obj in objects.items()}

    def update(restored: Dict[str, Any]) -> None:
        for name, obj in objects.items():
            nnx.update(obj, restored[name])

    def save(checkpointer: Any) -> Callable[[str], None]:
        def run(path: str) -> None:
            checkpointer.save(os.path.abspath(path), state())
            checkpointer.wait_until_finished()
        return run

    def load_uncompressed(path: str) -> None:
        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state())
        update(uncompressed.restore(os.path.abspath(path), args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))))

    def load_standard(path: str) -> None:
        update(standard.restore(os.path.abspath(path),
                                jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state())))

    return ({"orbax": contender(save(standard), load_standard, probe, **options),
             "orbax_uncompressed": contender(save(uncompressed), load_uncompressed, probe, **options)},
            lambda: (standard.close(), uncompressed.close()))


def async_save(accelerator: Any, path: str) -> Tuple[float, float]:
    """Our ``save_state(path, async_save=True)``: the seconds its call blocks, then the seconds
    until ``wait_for_checkpoint()`` returns (no garbage collected between: the save goes on)."""
    return timed(lambda: accelerator.save_state(path, async_save=True)), timed(accelerator.wait_for_checkpoint,
                                                                               collect_first=False)


def async_contender(accelerator: Any, blocking: str = "async blocking", wait: Optional[str] = "async wait",
                    total: str = "async total") -> Callable[..., Dict[str, float]]:
    """`async_save` as a contender (the keys of its values are given; no memory round)."""
    def run(path: str, memory: bool = False) -> Dict[str, float]:
        if memory:
            return {}
        times = async_save(accelerator, path)
        return {blocking: times[0], **({wait: times[1]} if wait else {}), total: sum(times)}

    return run


def dcp_contender(model: Any, optimizer: Any, probe: Any = None, storage: str = "folder", **options: Any
                  ) -> Callable[..., Dict[str, Any]]:
    """``torch.distributed.checkpoint`` as a `contender`, with the state dicts of its
    ``state_dict`` module (``get_state_dict`` / ``set_state_dict``, as its tutorials do), by
    ``storage``: ``folder`` (its default ``FileSystemWriter`` / ``Reader``: pickled ``.metadata``,
    shards in ``torch.save`` format), ``fsspec`` (``FsspecWriter`` / ``FsspecReader`` on a store's
    URL, the same format) or ``safetensors`` (``HuggingFaceStorageWriter(save_distributed=True)`` /
    ``Reader``, the storage ours uses; it takes tensors only, so the state dicts' tensor leaves
    under dotted names: the optimizer's hyper-parameters are not saved and ``set_state_dict``
    keeps the live ones)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def state() -> Dict[str, Any]:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def tensors_only(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(tensors_only(value, f"{prefix}{key}."))
            elif torch.is_tensor(value):
                out[f"{prefix}{key}"] = value
        return out

    def where(path: str, save: bool) -> Dict[str, Any]:
        if storage == "fsspec":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

            return {"storage_writer": FsspecWriter(path)} if save else {"storage_reader": FsspecReader(path)}
        if storage == "safetensors":
            from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

            return ({"storage_writer": HuggingFaceStorageWriter(path, save_distributed=True)} if save
                    else {"storage_reader": HuggingFaceStorageReader(path)})
        return {"checkpoint_id": path}

    pick = tensors_only if storage == "safetensors" else (lambda tree: tree)

    def load(path: str) -> None:
        live = state()
        dcp.load(pick(live), **where(path, False))  # in place, into the tensors of ``live``
        set_state_dict(model, optimizer, model_state_dict=live["model"], optim_state_dict=live["optimizer"])

    return contender(lambda path: dcp.save(pick(state()), **where(path, True)), load, probe, **options)


def path_rounds(contenders: Mapping[str, Callable[..., Any]], base: str, repeats: int, *,
                cleanup: Optional[Callable[[str], None]] = None, size: Optional[Callable[[str], Any]] = None,
                memory: bool = False, say: Optional[Callable[[str], None]] = log,
                describe: Optional[Callable[[Any], str]] = None) -> Dict[str, Any]:
    """`interleaved` rounds (one untimed warm-up call each, then ``repeats`` rounds in rotated
    order) of ``contender(path)``, every call on a path of its own under ``base``, which ``cleanup``
    (default `remove`: with `clean`'s wait for the kernel's writeback, so that no contender pays
    for another's dirty pages) deletes after it, untimed; ``size(path)`` first records what it left
    (``disk``). ``memory``: then one more call each, ``contender(path, memory=True)``. Returns
    ``{"samples": name -> key -> values, "disk": name -> size, "memory": name -> its value}``."""
    count, disk = itertools.count(), {}

    def on_path(name: str, run: Callable[..., Any], **options: Any) -> Callable[[], Any]:
        def call() -> Any:
            path = join(base, f"{name}_{next(count)}")
            value = run(path, **options)
            if size is not None:
                disk[name] = size(path)
            (cleanup or remove)(path)
            return value
        return call

    options = {"describe": describe} if describe else {}
    got = interleaved({n: on_path(n, run) for n, run in contenders.items()}, repeats, say=say, **options)
    out = {"samples": {name: columns(values) for name, values in got.items()}, "disk": disk}
    if memory:
        out["memory"] = {name: on_path(name, run, memory=True)() for name, run in contenders.items()}
    return out


@contextlib.contextmanager
def patched(*changes: Tuple[Any, str, Any]) -> Iterator[None]:
    """Attributes replaced for a ``with`` block, ``(object, name, value)`` each, then put back (an
    attribute the object did not hold itself, e.g. a method of its class, is removed again)."""
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in changes]
    for obj, name, value in changes:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, own in reversed(saved):
            delattr(obj, name) if own is _MISSING else setattr(obj, name, own)


class Phases:
    """Seconds per phase, summed over calls: ``phases.run(label, fn, *args)`` calls ``fn``, and
    inside ``with phases.timing([(object, attribute, label), ...])`` every call of an attribute
    adds to its label."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    def run(self, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        value, seconds = clocked(lambda: fn(*args, **kwargs))
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds
        return value

    def timing(self, targets: Iterable[Tuple[Any, str, str]]) -> Any:
        return patched(*((obj, attr, functools.partial(self.run, label, getattr(obj, attr)))
                         for obj, attr, label in targets))


# -- files, folders and store prefixes ------------------------------------------------------------------
def write_files(path: str, files: Mapping[str, Sequence[Any]]) -> None:
    """The raw limit's save: one file per name, its arrays written from their own memory (one
    ``write`` each), each file fsynced, then the folder (no header, no checksum; durable, as a
    synchronous ``save_state`` is when it returns)."""
    os.makedirs(path, exist_ok=True)
    for name, arrays in files.items():
        with open(os.path.join(path, name), "wb") as handle:
            for array in arrays:
                handle.write(memoryview(array).cast("B"))
            handle.flush()
            os.fsync(handle.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_into(handle: Any, buffer: Any, chunk: int = 64 << 20) -> None:
    """Fill ``buffer`` (any writable buffer) from ``handle`` with ``readinto``, ``chunk`` at a time."""
    view, got = memoryview(buffer).cast("B"), 0
    while got < len(view):
        got += handle.readinto(view[got:got + chunk])


def read_files(path: str, buffers: Dict[str, bytearray], names: Optional[Iterable[str]] = None) -> None:
    """The raw limit's load: each file (``names``, default all) read into ``buffers[name]``, warm
    memory of its size (allocated and touched by a first read, then reused): nothing verified."""
    for name in sorted(os.listdir(path)) if names is None else names:
        file = os.path.join(path, name)
        if len(buffers.get(name, b"")) != os.path.getsize(file):
            buffers[name] = bytearray(os.path.getsize(file))  # zero-filled: touched
        with open(file, "rb", buffering=0) as handle:
            read_into(handle, buffers[name])


def raw_limit(files: Callable[[], Mapping[str, Sequence[Any]]], **options: Any) -> Callable[..., Dict[str, Any]]:
    """The physical limit of a save and a load as a `contender`: the live arrays (``files()``: per
    file, NumPy views of their memory) through `write_files` and `read_files`, or on a store
    through `upload_raw` and `download_raw` (the same client as ours); the buffers they are read
    into are allocated and touched in the untimed warm-up round, then reused."""
    buffers: Dict[str, bytearray] = {}
    names: List[str] = []  # the objects of the last save

    def save(path: str) -> None:
        written = files()
        names[:] = written
        if "://" not in path:
            return write_files(path, written)
        for name, arrays in written.items():
            upload_raw(store(), join(path, name), arrays)

    def load(path: str) -> None:
        if "://" not in path:
            return read_files(path, buffers)
        store().invalidate_cache()
        for name in names:
            buffers[name] = download_raw(store(), join(path, name), buffers.get(name, bytearray()))

    return contender(save, load, **options)


def join(base: str, name: str) -> str:
    """``base/name`` for a folder or a store URL."""
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


def remove(path: str) -> None:
    """A checkpoint folder (`clean`), or every object under a store prefix."""
    if "://" not in path:
        clean(path)
        return
    fs = store()
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache()


def clean(path: str) -> None:
    """Delete a checkpoint folder and our commit's temporaries beside it, ``os.sync()``, and wait
    until the kernel has written back the dirty pages (``Dirty:`` in /proc/meminfo under 64 MiB,
    60 s at most), so that no timed save pays for another's writeback."""
    shutil.rmtree(path, ignore_errors=True)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(parent):  # temporaries / replaced directories of our atomic commit
        for entry in os.listdir(parent):
            if entry.startswith("." + os.path.basename(path)):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    os.sync()
    deadline = time.monotonic() + 60.0
    while _dirty_bytes() >= 64 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)


def _dirty_bytes() -> int:
    try:
        with open("/proc/meminfo") as handle:
            return next((int(line.split()[1]) * 1024 for line in handle if line.startswith("Dirty:")), 0)
    except OSError:
        return 0


def stored_bytes(path: str) -> Dict[str, int]:
    """Files, apparent size and allocated bytes under a folder, or under a store prefix (allocated:
    the objects' sizes)."""
    if "://" in path:
        fs = store()
        fs.invalidate_cache()
        sizes = [int(info["size"]) for info in fs.find(path, detail=True).values()]
        return {"files": len(sizes), "apparent": sum(sizes), "allocated": sum(sizes)}
    stats = [os.lstat(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names]
    return {"apparent": sum(s.st_size for s in stats), "allocated": sum(s.st_blocks * 512 for s in stats),
            "files": len(stats)}


# -- an object store ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server (the one s3fs's own tests run against) in a process of its own on
    127.0.0.1, so that its work does not share the benchmark's interpreter; for the ``with`` block
    the environment (inherited by the parts) points at it. Yields the endpoint."""
    from unified.launcher.launch import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start within 30 s") from None
                time.sleep(0.2)
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1")
        yield endpoint
    finally:
        server.kill()
        server.wait()


def store() -> Any:
    import fsspec

    return fsspec.filesystem("s3")


def bucket(prefix: str) -> str:
    """A new bucket ``<prefix>-<time>``: ``s3://NAME``."""
    name = f"{prefix}-{int(time.time())}"
    store().mkdir(name)
    return f"s3://{name}"


def upload_raw(fs: Any, url: str, arrays: Iterable[Any]) -> None:
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
    with fs.open(url, "rb", block_size=PART_BYTES, cache_type="none") as handle:
        read_into(handle, buffer, PART_BYTES)
    return buffer
