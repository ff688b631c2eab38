"""The GPU path in one command: run the CUDA tests, then time saves and loads of device state.

Run from the repository root on a machine with a GPU:

    python -m benchmarks.gpu_check [--gb 2] [--repeats 3] [--dir DIR] [--parts torch,jax]
                                   [--doc docs/benchmarks/gpu.md]

What it needs: the Python packages already installed (torch with CUDA; jax with its CUDA plugin,
flax, optax, orbax-checkpoint; safetensors, xxhash; accelerate for the torch peer row), possibly
newer than the tested versions; run from this repository's root; no network. Sized to finish in
under 8 minutes on one GPU with the defaults.

1. ``tests/gpu`` (pytest, at most 240 s): device selection, the CUDA generator in checkpoints,
   the fp16 scaler and bf16 autocast on CUDA, async saves of device memory, GPU <-> CPU
   checkpoints on both backends. Its summary line is printed.
2. For each framework with a GPU, in a fresh process of its own (``--part torch|jax``): a model
   holding ``--gb`` GB of float32 parameters on the device, then, after a warm-up round, in
   rotated order for ``--repeats`` rounds (`checkpointing.path_rounds`):

   * the limit: the same bytes copied device -> host (pinned memory on torch) and written to one
     file per array, then fsynced; read back into host memory and put on the device;
   * ours: ``save_state`` (synchronous), ``save_state(async_save=True)`` (the time the call
     blocks the training, then the time until ``wait_for_checkpoint()`` returned), ``load_state``;
   * the peer: Accelerate's ``save_state`` / ``load_state`` (torch) or Orbax's
     ``StandardCheckpointer`` save + restore onto the device (JAX).

   Each load is checked (a parameter changed after the save must come back; the change and the
   check are outside the timing). Peak device memory beyond the state, and peak host RSS, of
   one more untimed load (JAX: device memory sampled every 0.5 ms), beside the same load with
   every array read into host memory first (the way before issue 29).

The table is printed last (``--doc PATH`` also writes it as markdown). Without a CUDA device it
prints one line saying so and exits 0. ``--allow-cpu`` runs part 2 on CPU (tiny sizes), to
check this script where no GPU is.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from benchmarks.checkpointing import (
    async_save,
    contender,
    jax_probe,
    nnx_stack,
    orbax_contenders,
    path_rounds,
    read_into,
    torch_probe,
    write_files,
)
from benchmarks.runner import (
    ROOT,
    PartFailed,
    PeakMemory,
    cells,
    command,
    emit,
    environment,
    module,
    print_command,
    run_part,
    table,
)
from unified.runtime.environment import IN_PLACE_VARIABLE

TEST_TIMEOUT_S = 240
PART_TIMEOUT_S = 300
NAMES = ("save", "load")


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


def _ours(accelerator: Any, probe: Any, sync: Callable[[], Any]) -> Callable[..., Dict[str, float]]:
    """Our synchronous save and the checked load, then an async save: how long its call blocks the
    training, and how long until `wait_for_checkpoint()` returned."""
    trip = contender(lambda f: (accelerator.save_state(f), sync()), lambda f: (accelerator.load_state(f), sync()),
                     probe, names=NAMES)

    def run(folder: str) -> Dict[str, float]:
        out = trip(folder)
        shutil.rmtree(folder)
        sync()
        blocked, wait = async_save(accelerator, folder)
        return {**out, "async_blocked": blocked, "async_total": blocked + wait}

    return run


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
    probe = torch_probe(model)
    def tensors() -> List[Any]:  # the live parameters (a load may have replaced small ones)
        return [p.detach() for p in model.parameters()]

    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors()]

    def raw_save(folder: str) -> None:
        for host, tensor in zip(pinned, tensors()):
            host.copy_(tensor, non_blocking=cuda)
        sync()
        write_files(folder, {f"{i}.bin": [host.numpy()] for i, host in enumerate(pinned)})

    def raw_load(folder: str) -> None:
        for i, (host, tensor) in enumerate(zip(pinned, tensors())):
            with open(os.path.join(folder, f"{i}.bin"), "rb") as handle:
                read_into(handle, host.numpy())
            tensor.copy_(host, non_blocking=cuda)
        sync()

    contenders = {"raw copy + write + fsync": contender(raw_save, raw_load, probe, names=NAMES),
                  "unified": _ours(ours, probe, sync)}
    peer_note = None
    try:
        import accelerate

        peer = accelerate.Accelerator(cpu=not cuda)
        peer_model = peer.prepare(build())
        contenders[f"accelerate {accelerate.__version__}"] = contender(
            lambda f: (peer.save_state(f), sync()), lambda f: (peer.load_state(f), sync()), torch_probe(peer_model),
            names=NAMES)
    except ImportError:
        peer_note = "accelerate is not installed: no peer row"
    times = path_rounds(contenders, args.dir, args.repeats)["samples"]

    def reset_peak() -> Callable[[], int]:
        torch.cuda.reset_peak_memory_stats(device)
        return lambda: torch.cuda.max_memory_allocated(device)

    memory = _load_memory(ours, os.path.join(args.dir, "memory"), probe, sync,
                          lambda: DevicePeak((lambda: torch.cuda.memory_allocated(device)) if cuda else None,
                                             reset_peak))
    state_bytes = sum(t.numel() * t.element_size() for t in tensors())
    ours.end_training()
    return {"part": "torch", "device": torch.cuda.get_device_name(0) if cuda else "cpu", "state_gb": state_bytes / 1e9,
            "versions": {"torch": torch.__version__}, "times": times, "memory": memory, "note": peer_note}


# -- JAX -----------------------------------------------------------------------------------------
def jax_part(args: argparse.Namespace) -> Dict[str, Any]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    from unified import Accelerator

    hidden = args.hidden
    layers = max(1, int(args.gb * 1e9 / (4 * hidden * hidden)))
    ours = Accelerator(backend="jax")
    model = ours.prepare(nnx_stack(hidden, layers))
    probe = jax_probe(model)

    def sync() -> None:
        jax.block_until_ready(nnx.state(model))

    def leaves() -> List[Any]:
        return jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))

    def raw_load(folder: str) -> None:
        live, treedef = jax.tree_util.tree_flatten(nnx.state(model, nnx.Param))
        restored = []
        for i, leaf in enumerate(live):
            host = np.empty(leaf.shape, leaf.dtype)
            with open(os.path.join(folder, f"{i}.bin"), "rb") as handle:
                read_into(handle, host)
            restored.append(jax.device_put(host, leaf.sharding))
        nnx.update(model, jax.tree_util.tree_unflatten(treedef, restored))
        sync()

    orbax, close = orbax_contenders({"model": model}, probe, names=NAMES)
    contenders = {"raw copy + write + fsync": contender(
        lambda f: write_files(f, {f"{i}.bin": [np.asarray(leaf)] for i, leaf in enumerate(leaves())}), raw_load, probe,
        names=NAMES), "unified": _ours(ours, probe, sync),
        f"orbax {getattr(ocp, '__version__', '')}".strip(): orbax["orbax"]}
    times = path_rounds(contenders, args.dir, args.repeats)["samples"]
    close()
    stats = jax.devices()[0].memory_stats  # XLA's peak_bytes_in_use cannot be reset: sampled
    memory = _load_memory(ours, os.path.join(args.dir, "memory"), probe, sync,
                          lambda: DevicePeak((lambda: stats()["bytes_in_use"]) if stats() else None))
    state_bytes = sum(leaf.nbytes for leaf in leaves())
    ours.end_training()
    return {"part": "jax", "device": str(jax.devices()[0].device_kind), "state_gb": state_bytes / 1e9,
            "versions": {"jax": jax.__version__}, "times": times, "memory": memory, "note": None}


def _load_memory(accelerator: Any, folder: str, probe: Any, sync: Callable[[], Any],
                 device_peak: Callable[[], "DevicePeak"]) -> Dict[str, Dict[str, Optional[float]]]:
    """Peak device memory beyond the state and peak host RSS added, in MB, of one untimed load
    of ``accelerator``'s state from ``folder``, beside the same load with every array read into
    fresh memory first (the way before issue 29)."""
    memory: Dict[str, Dict[str, Optional[float]]] = {}
    accelerator.save_state(folder)
    for name, extra in (("unified", {}), ("unified, every array into fresh memory (before issue 29)",
                                          {IN_PLACE_VARIABLE: str(1 << 60)})):
        probe.mutate()
        with environment(**extra), device_peak() as device, PeakMemory(trim=True, anonymous=False) as host:
            accelerator.load_state(folder)
            sync()
        probe.check()
        memory[name] = {"device_mb": None if device.beyond is None else device.beyond / 1e6,
                        "host_mb": (host.peak - host.before) / 1e6}
    shutil.rmtree(folder, ignore_errors=True)
    return memory


class DevicePeak:
    """The most device memory in use during a block beyond what was in use before it
    (``beyond``: bytes, or ``None`` without ``in_use``, where there is no device). ``exact()``,
    called on entry, resets the framework's own peak and returns how to read it (torch);
    without it ``in_use`` is sampled every 0.5 ms (JAX)."""

    def __init__(self, in_use: Optional[Callable[[], int]],
                 exact: Optional[Callable[[], Callable[[], int]]] = None) -> None:
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
        rows = [[name, what.replace("_", " "), *cells(measured[what], "min median max ratio",
                                                      statistics.median(raw["load" if what == "load" else "save"]))]
                for name, measured in times.items() for what in ("save", "async_blocked", "async_total", "load")
                if what in measured]
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
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               str(ROOT / "tests" / "gpu")],
                              cwd=str(ROOT), capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"did not finish within {TEST_TIMEOUT_S} s"
    print(done.stdout[-6000:], flush=True)
    summary = [line for line in done.stdout.splitlines()
               if " passed" in line or " failed" in line or " skipped" in line]
    return summary[-1].strip("= ") if summary else f"pytest exited {done.returncode}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="GB of float32 parameters on the device (default 2)")
    parser.add_argument("--hidden", type=int, default=8192, help="width of each square layer (default 8192)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--parts", default="torch,jax")
    parser.add_argument("--doc", default=None, help="also write the table to this markdown file")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="time on CPU where there is no GPU (checks this script)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--part", choices=["torch", "jax"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        os.makedirs(args.dir, exist_ok=True)
        emit((torch_part if args.part == "torch" else jax_part)(args))
        return 0
    devices = _devices()
    wanted = [p for p in args.parts.split(",") if p]
    runnable = [p for p in wanted if devices.get(p) or args.allow_cpu]
    if not any(devices.values()) and not args.allow_cpu:
        print(f"gpu_check: no CUDA device (torch sees {devices['torch']}, JAX sees {devices['jax']} GPUs): "
              "skipped; run it on a GPU machine (docs/gpu.md)")
        return 0
    print_command()
    print(f"gpu_check: GPUs seen by torch {devices['torch']}, by JAX {devices['jax']}", flush=True)
    tests = "not run (--skip-tests)" if args.skip_tests else _run_tests()
    base = args.dir or tempfile.mkdtemp(prefix="unified-gpu-check-")
    results = []
    for part in runnable:
        try:
            results.append(run_part(module("gpu_check", "--part", part, "--gb", str(args.gb),
                                           "--hidden", str(args.hidden), "--repeats", str(args.repeats),
                                           "--dir", os.path.join(base, part)),
                                    {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, PART_TIMEOUT_S, quiet=True))
        except PartFailed as failure:
            results.append({"part": part, "error": str(failure)[-1500:]})
        except subprocess.TimeoutExpired:
            results.append({"part": part, "error": f"did not finish within {PART_TIMEOUT_S} s"})
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    text = report(results, tests)
    if args.doc:
        Path(args.doc).write_text(f"# The GPU check\n\nProduced by `{command()}`.\n\n{text}\n")
    print(text)
    failed = "failed" in tests or "did not finish" in tests or any("error" in r for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
