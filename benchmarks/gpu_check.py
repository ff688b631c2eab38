"""The GPU path in one command: run the CUDA tests, then time saves and loads of device state.

Run from the repository root on a machine with a GPU:

    python benchmarks/gpu_check.py [--gb 2] [--repeats 3] [--dir DIR] [--parts torch,jax]
                                   [--doc docs/benchmarks/gpu.md]

What it needs: the Python packages already installed (torch with CUDA; jax with its CUDA plugin,
flax, optax, orbax-checkpoint; safetensors, xxhash; accelerate for the torch peer row), possibly
newer than the tested versions; this repository on ``PYTHONPATH`` (or the working directory);
no network. Sized to finish in under 8 minutes on one GPU with the defaults.

1. ``tests/gpu`` (pytest, at most 240 s): device selection, the CUDA generator in checkpoints,
   the fp16 scaler and bf16 autocast on CUDA, async saves of device memory, GPU <-> CPU
   checkpoints on both backends. Its summary line is printed.
2. For each framework with a GPU, in a fresh process of its own (``--part torch|jax``): a model
   holding ``--gb`` GB of float32 parameters on the device, then, in rotated order for
   ``--repeats`` rounds:

   * the limit: the same bytes copied device -> host (pinned memory on torch) and written to one
     file per array, then fsynced; read back into host memory and put on the device;
   * ours: ``save_state`` (synchronous), ``save_state(async_save=True)`` (the time the call
     blocks the training, then the time until ``wait_for_checkpoint()`` returned), ``load_state``;
   * the peer: Accelerate's ``save_state`` / ``load_state`` (torch) or Orbax's
     ``StandardCheckpointer`` save + restore onto the device (JAX).

   Each load is checked (a parameter changed after the save must come back). Peak device
   memory beyond the state, and peak host RSS, of one more untimed load (JAX: device memory
   sampled every 0.5 ms), beside the same load with every array read into host memory first
   (the way before issue 29).

The table is printed last (``--doc PATH`` also writes it as markdown). Without a CUDA device it
prints one line saying so and exits 0. ``--allow-cpu`` runs part 2 on CPU (tiny sizes), to
check this script where no GPU is.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from mdtable import spread, table  # noqa: E402
from memory import PeakMemory  # noqa: E402
from unified.environment import IN_PLACE_VARIABLE  # noqa: E402

TEST_TIMEOUT_S = 240
PART_TIMEOUT_S = 300


def _devices() -> Dict[str, int]:
    """GPUs per framework, each asked in a process of its own (JAX would keep its client)."""
    probes = {"torch": "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)",
              "jax": "import jax\ntry:\n    print(len(jax.devices('gpu')))\nexcept RuntimeError:\n    print(0)"}
    found = {}
    for name, code in probes.items():
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            found[name] = int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            found[name] = 0
    return found


def _fsync_write(path: str, chunks: List[Any]) -> None:
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(memoryview(chunk).cast("B"))
        handle.flush()
        os.fsync(handle.fileno())


def _rounds(contenders: Dict[str, Callable[[str], Dict[str, float]]], base: str, repeats: int) -> Dict[str, Dict[str, List[float]]]:
    """One untimed warm-up each, then ``repeats`` rounds in rotated order; each contender's
    folder is removed and the page cache written back between contenders."""
    names = list(contenders)
    times: Dict[str, Dict[str, List[float]]] = {name: {} for name in names}
    for round_index in range(repeats + 1):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            folder = os.path.join(base, name)
            measured = contenders[name](folder)
            shutil.rmtree(folder, ignore_errors=True)
            os.sync()
            if round_index:
                for key, value in measured.items():
                    times[name].setdefault(key, []).append(value)
    return times


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _ours_round(accelerator: Any, folder: str, sync: Callable[[], None], checked_load: Callable[[], None]) -> Dict[str, float]:
    """Our synchronous save, the checked load, then an async save: how long its call blocks the
    training, and how long until `wait_for_checkpoint()` returned."""
    out = {"save": _timed(lambda: (accelerator.save_state(folder), sync()))}
    out["load"] = _timed(checked_load)
    shutil.rmtree(folder)
    sync()
    started = time.perf_counter()
    accelerator.save_state(folder, async_save=True)
    out["async_blocked"] = time.perf_counter() - started
    accelerator.wait_for_checkpoint()
    out["async_total"] = time.perf_counter() - started
    return out


# -- torch ---------------------------------------------------------------------------------------
def torch_part(args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    from unified import Accelerator

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    hidden = args.hidden
    layers = max(1, int(args.gb * 1e9 / (4 * hidden * hidden)))

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]).to(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    ours = Accelerator(backend="torch")
    model = ours.prepare(build())
    first = next(model.parameters())

    def mutate_and_check(load: Callable[[], Any], target: torch.Tensor) -> None:
        saved = target[0, :4].clone()
        with torch.no_grad():
            target.add_(1.0)
        load()
        sync()
        if not torch.equal(target[0, :4], saved):
            raise AssertionError("a load did not bring the saved parameter back")

    def ours_round(folder: str) -> Dict[str, float]:
        return _ours_round(ours, folder, sync, lambda: mutate_and_check(lambda: ours.load_state(folder), first))

    tensors = [p.detach() for p in model.parameters()]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]

    def raw_round(folder: str) -> Dict[str, float]:
        os.makedirs(folder)

        def save() -> None:
            for host, tensor in zip(pinned, tensors):
                host.copy_(tensor, non_blocking=cuda)
            sync()
            for i, host in enumerate(pinned):
                _fsync_write(os.path.join(folder, f"{i}.bin"), [host.numpy()])

        def load() -> None:
            for i, (host, tensor) in enumerate(zip(pinned, tensors)):
                with open(os.path.join(folder, f"{i}.bin"), "rb") as handle:
                    handle.readinto(memoryview(host.numpy()).cast("B"))
                tensor.copy_(host, non_blocking=cuda)
            sync()

        return {"save": _timed(save), "load": _timed(lambda: mutate_and_check(load, tensors[0]))}

    contenders = {"raw copy + write + fsync": raw_round, "unified": ours_round}
    peer_note = None
    try:
        import accelerate

        peer = accelerate.Accelerator(cpu=not cuda)
        peer_model = peer.prepare(build())
        peer_first = next(peer_model.parameters())

        def peer_round(folder: str) -> Dict[str, float]:
            out = {"save": _timed(lambda: (peer.save_state(folder), sync()))}
            out["load"] = _timed(lambda: mutate_and_check(lambda: peer.load_state(folder), peer_first))
            return out

        contenders[f"accelerate {accelerate.__version__}"] = peer_round
    except ImportError:
        peer_note = "accelerate is not installed: no peer row"
    times = _rounds(contenders, args.dir, args.repeats)

    def reset_peak() -> Callable[[], int]:
        torch.cuda.reset_peak_memory_stats(device)
        return lambda: torch.cuda.max_memory_allocated(device)

    memory = _load_memory(ours, os.path.join(args.dir, "memory"), lambda folder: mutate_and_check(lambda: ours.load_state(folder), first),
                          lambda: DevicePeak((lambda: torch.cuda.memory_allocated(device)) if cuda else None, reset_peak))
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    ours.end_training()
    return {"part": "torch", "device": torch.cuda.get_device_name(0) if cuda else "cpu", "state_gb": state_bytes / 1e9,
            "versions": {"torch": torch.__version__}, "times": times, "memory": memory, "note": peer_note}


# -- JAX -----------------------------------------------------------------------------------------
def jax_part(args: argparse.Namespace) -> Dict[str, Any]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    from checkpoint import nnx_stack
    from unified import Accelerator

    hidden = args.hidden
    layers = max(1, int(args.gb * 1e9 / (4 * hidden * hidden)))

    def block(tree: Any) -> Any:
        return jax.block_until_ready(tree)

    ours = Accelerator(backend="jax")
    model = ours.prepare(nnx_stack(hidden, layers))

    def kernel() -> Any:
        return model.layers[0].kernel

    def mutate_and_check(load: Callable[[], Any]) -> None:
        saved = np.asarray(kernel().value[0, :4])
        kernel().value = kernel().value + 1.0
        load()
        block(nnx.state(model))
        if not np.array_equal(np.asarray(kernel().value[0, :4]), saved):
            raise AssertionError("a load did not bring the saved parameter back")

    def ours_round(folder: str) -> Dict[str, float]:
        return _ours_round(ours, folder, lambda: None, lambda: mutate_and_check(lambda: ours.load_state(folder)))

    def raw_round(folder: str) -> Dict[str, float]:
        os.makedirs(folder)
        leaves, treedef = jax.tree_util.tree_flatten(nnx.state(model, nnx.Param))

        def save() -> None:
            for i, leaf in enumerate(leaves):
                _fsync_write(os.path.join(folder, f"{i}.bin"), [np.asarray(leaf)])

        def load() -> None:
            restored = []
            for i, leaf in enumerate(leaves):
                host = np.empty(leaf.shape, leaf.dtype)
                with open(os.path.join(folder, f"{i}.bin"), "rb") as handle:
                    handle.readinto(memoryview(host).cast("B"))
                restored.append(jax.device_put(host, leaf.sharding))
            nnx.update(model, jax.tree_util.tree_unflatten(treedef, restored))

        return {"save": _timed(save), "load": _timed(lambda: mutate_and_check(load))}

    checkpointer = ocp.StandardCheckpointer()

    def orbax_round(folder: str) -> Dict[str, float]:
        state = nnx.state(model, nnx.Param)

        def save() -> None:
            checkpointer.save(os.path.abspath(folder), state)
            checkpointer.wait_until_finished()

        def load() -> None:
            target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, nnx.state(model, nnx.Param))
            nnx.update(model, checkpointer.restore(os.path.abspath(folder), target))

        return {"save": _timed(save), "load": _timed(lambda: mutate_and_check(load))}

    contenders = {"raw copy + write + fsync": raw_round, "unified": ours_round,
                  f"orbax {ocp.__version__ if hasattr(ocp, '__version__') else ''}".strip(): orbax_round}
    times = _rounds(contenders, args.dir, args.repeats)
    stats = jax.devices()[0].memory_stats  # XLA's peak_bytes_in_use cannot be reset: sampled
    memory = _load_memory(ours, os.path.join(args.dir, "memory"), lambda folder: mutate_and_check(lambda: ours.load_state(folder)),
                          lambda: DevicePeak((lambda: stats()["bytes_in_use"]) if stats() else None))
    state_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    ours.end_training()
    return {"part": "jax", "device": str(jax.devices()[0].device_kind), "state_gb": state_bytes / 1e9,
            "versions": {"jax": jax.__version__}, "times": times, "memory": memory, "note": None}


def _load_memory(accelerator: Any, folder: str, checked_load: Callable[[str], None],
                 device_peak: Callable[[], "DevicePeak"]) -> Dict[str, Dict[str, Optional[float]]]:
    """Peak device memory beyond the state and peak host RSS added, in MB, of one untimed load
    of ``accelerator``'s state from ``folder``, beside the same load with every array read into
    fresh memory first (the way before issue 29)."""
    memory: Dict[str, Dict[str, Optional[float]]] = {}
    accelerator.save_state(folder)
    fresh = {IN_PLACE_VARIABLE: str(1 << 60)}
    for name, extra in (("unified", {}), ("unified, every array into fresh memory (before issue 29)", fresh)):
        os.environ.update(extra)
        try:
            with device_peak() as device, PeakMemory(trim=True, anonymous=False) as host:
                checked_load(folder)
        finally:
            for key in extra:
                os.environ.pop(key, None)
        memory[name] = {"device_mb": None if device.beyond is None else device.beyond / 1e6,
                        "host_mb": (host.peak - host.before) / 1e6}
    shutil.rmtree(folder, ignore_errors=True)
    return memory


class DevicePeak:
    """The most device memory in use during a block beyond what was in use before it
    (``beyond``: bytes, or ``None`` without ``in_use``, where there is no device). ``exact()``,
    called on entry, resets the framework's own peak and returns how to read it (torch);
    without it ``in_use`` is sampled every 0.5 ms (JAX)."""

    def __init__(self, in_use: Optional[Callable[[], int]], exact: Optional[Callable[[], Callable[[], int]]] = None) -> None:
        self.in_use, self.exact, self.beyond = in_use, exact, None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "DevicePeak":
        if self.in_use is None:
            return self
        self._read_peak = self.exact() if self.exact else None
        self._before = self._peak = self.in_use()
        if self._read_peak is None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.0005):
            self._peak = max(self._peak, self.in_use())

    def __exit__(self, *exc: Any) -> None:
        if self.in_use is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._peak = self._read_peak() if self._read_peak else max(self._peak, self.in_use())
        self.beyond = self._peak - self._before


# -- report --------------------------------------------------------------------------------------
def report(results: List[Dict[str, Any]], tests: str) -> str:
    lines = [f"tests/gpu: {tests}", ""]
    for res in results:
        if "error" in res:
            lines += [f"{res['part']}: failed: {res['error']}", ""]
            continue
        times = res["times"]
        raw = times["raw copy + write + fsync"]
        lines.append(f"**{res['part']}** on {res['device']}, {res['state_gb']:.2f} GB of device state "
                     f"({', '.join(f'{k} {v}' for k, v in res['versions'].items())}); seconds, over "
                     f"{len(raw['save'])} rounds; ratio: median / the limit's median")
        lines.append("")
        rows = []
        for name, measured in times.items():
            for what in ("save", "async_blocked", "async_total", "load"):
                if what in measured:
                    reference = raw["load" if what == "load" else "save"]
                    rows.append([name, what.replace("_", " "), *spread(measured[what], statistics.median(reference))])
        lines.append(table(["contender", "call", "min (s)", "median", "max", "median / limit"], "llrrrr", rows))
        lines.append("")
        lines.append(table(["contender", "peak device memory beyond the state (MB)", "peak host RSS added (MB)"], "lrr",
                           [[name, "n/a" if m["device_mb"] is None else f"{m['device_mb']:.0f}", f"{m['host_mb']:.0f}"]
                            for name, m in res["memory"].items()]))
        if res.get("note"):
            lines.append(f"\n{res['note']}")
        lines.append("")
    return "\n".join(lines)


def _run_tests() -> str:
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(ROOT / "tests" / "gpu")],
                              cwd=str(ROOT), capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"did not finish within {TEST_TIMEOUT_S} s"
    print(done.stdout[-6000:], flush=True)
    summary = [line for line in done.stdout.splitlines() if " passed" in line or " failed" in line or " skipped" in line]
    return summary[-1].strip("= ") if summary else f"pytest exited {done.returncode}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="GB of float32 parameters on the device (default 2)")
    parser.add_argument("--hidden", type=int, default=8192, help="width of each square layer (default 8192)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--parts", default="torch,jax")
    parser.add_argument("--doc", default=None, help="also write the table to this markdown file")
    parser.add_argument("--allow-cpu", action="store_true", help="time on CPU where there is no GPU (checks this script)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--part", choices=["torch", "jax"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        os.makedirs(args.dir, exist_ok=True)
        print(json.dumps((torch_part if args.part == "torch" else jax_part)(args)))
        return 0
    devices = _devices()
    wanted = [p for p in args.parts.split(",") if p]
    runnable = [p for p in wanted if devices.get(p) or args.allow_cpu]
    if not any(devices.values()) and not args.allow_cpu:
        print(f"gpu_check: no CUDA device (torch sees {devices['torch']}, JAX sees {devices['jax']} GPUs): "
              "skipped; run it on a GPU machine (docs/gpu.md)")
        return 0
    print(f"gpu_check: GPUs seen by torch {devices['torch']}, by JAX {devices['jax']}", flush=True)
    tests = "not run (--skip-tests)" if args.skip_tests else _run_tests()
    base = args.dir or tempfile.mkdtemp(prefix="unified-gpu-check-")
    results = []
    for part in runnable:
        cmd = [sys.executable, __file__, "--part", part, "--gb", str(args.gb), "--hidden", str(args.hidden),
               "--repeats", str(args.repeats), "--dir", os.path.join(base, part)]
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PART_TIMEOUT_S, env=env)
            if done.returncode:
                results.append({"part": part, "error": (done.stderr or done.stdout)[-1500:]})
            else:
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        except subprocess.TimeoutExpired:
            results.append({"part": part, "error": f"did not finish within {PART_TIMEOUT_S} s"})
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    text = report(results, tests)
    if args.doc:
        command = " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]])
        Path(args.doc).write_text(f"# The GPU check\n\nProduced by `{command}`.\n\n{text}\n")
    print(text)
    failed = "failed" in tests or "did not finish" in tests or any("error" in r for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
