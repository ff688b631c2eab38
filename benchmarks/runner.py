"""What every benchmark runs on: contenders measured in interleaved rounds, their statistics and
peak memory, the markdown tables, and the result of a part measured in a process of its own.

* `interleaved`: every contender warmed up, then rounds in which each runs once, in an order
  rotated by one every round (drift in the machine's load hits all alike); before every call a
  full garbage collection, untimed (`collect`).
* `timed`, `measured`, `clocked`: one call's seconds (and its peak memory: `PeakMemory`).
* `stats`, `cells`, `table`: min / median / max / spread of samples as markdown cells and tables.
* `emit`, `run_part`, `run_launched`, `launch_each`, `main_launched`: a part of a benchmark in a
  process (or a launched group) of its own, and its result back in the parent.
* `print_command`, `Run.machine`: the command that produced the tables, and the machine.

The pictures are `benchmarks.plot`'s. Example::

    samples = interleaved({"ours": ours, "raw": raw}, rounds=5)     # name -> seconds per round
    print(table(["loop", "min (s)", "median", "max", "median / raw"], "lrrrr",
                [[name, *cells(values, "min median max ratio", statistics.median(samples["raw"]))]
                 for name, values in samples.items()]))
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from unified.runtime.libc import return_free_heap

ROOT = Path(__file__).resolve().parents[1]
MARKER = "UNIFIED_BENCH_JSON "
GB, MB = 1e9, 1e6


def log(*args: Any) -> None:
    """Progress, on stderr (stdout holds the tables)."""
    print(*args, file=sys.stderr, flush=True)


# -- one call ---------------------------------------------------------------------------------------
def collect() -> None:
    """A full garbage collection before a timing, outside it, as ``timeit`` turns the collector off:
    else a collection of the script's own garbage (building a benchmark's objects makes many
    Python objects: 60-130 ms for the JAX checkpoint's) falls inside whichever timed call first
    allocates enough (docs/benchmarks/checkpoint.md). ``UNIFIED_BENCH_GC_DEBT=1``: none (as before)."""
    if os.environ.get("UNIFIED_BENCH_GC_DEBT") != "1":
        gc.collect()


def clocked(fn: Callable[..., Any], *args: Any) -> Tuple[Any, float]:
    """``fn(*args)`` and its seconds: the benchmarks' stopwatch (collectives.py's per-call loop
    keeps its own, in nanoseconds, with nothing between the calls)."""
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def _call(fn: Callable[[], Any], sync: Optional[Callable[[], None]], collect_first: bool = True) -> Tuple[Any, float]:
    if collect_first:
        collect()
    if sync is not None:
        sync()
    return clocked(fn)


def timed(fn: Callable[[], Any], sync: Optional[Callable[[], None]] = None, *, collect_first: bool = True) -> float:
    """``fn()``'s seconds, after `collect` (``collect_first=False``: none, e.g. where work goes on
    in the background) and ``sync()`` (a barrier: every process starts together), both untimed."""
    return _call(fn, sync, collect_first)[1]


def measured(fn: Callable[[], Any], sync: Optional[Callable[[], None]] = None, *, trim: bool = False,
             anonymous: bool = False) -> Dict[str, float]:
    """`timed` inside `PeakMemory` (``trim``, ``anonymous``: its options): ``s``, and the RSS
    before, at the peak and after the call (``rss_*``; "after" once the C heap handed its free
    memory back: the arrays a JAX load replaced are freed, but glibc keeps their memory, which
    would otherwise count as live state), with ``anonymous`` also ``anon_before`` / ``anon_peak``."""
    collect()
    with PeakMemory(trim=trim, anonymous=anonymous) as memory:
        seconds = _call(fn, sync, collect_first=False)[1]
    return_free_heap()
    return {"s": seconds, "rss_before": memory.before, "rss_peak": memory.peak, "rss_after": status_bytes("VmRSS"),
            "anon_before": memory.anon_before, "anon_peak": memory.anon_peak}


def beyond(call: Mapping[str, float]) -> float:
    """A `measured` call's peak RSS beyond the live state: the larger of the RSS before and after."""
    return call["rss_peak"] - max(call["rss_before"], call.get("rss_after", 0.0))


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``), in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


class PeakMemory:
    """The peak resident memory of this process during a ``with`` block (Linux), in bytes after it:

    * ``before`` / ``peak``: RSS (anonymous memory and mapped file pages). The peak is ``VmHWM``
      after a reset through /proc/self/clear_refs (kernel-exact, no sampling), or, where that
      cannot be written, ``VmRSS`` sampled every 2 ms; ``method`` says which.
    * ``anon_before`` / ``anon_peak``: anonymous memory alone (``RssAnon``: what the code
      allocated, apart from the file pages it mapped, which the kernel can drop at any time),
      sampled every 2 ms in a thread (the kernel keeps no peak of it) and once more at the end.

    ``anonymous=False`` leaves ``anon_*`` at 0 and starts no sampling thread when ``VmHWM``
    serves (a timed call then runs with nothing beside it).

    ``trim=True`` first hands the C heap's free memory back to the kernel (glibc ``malloc_trim``),
    so that memory an earlier call freed, which the heap keeps resident, is not counted in
    ``before`` and then reused unseen: ``peak - before`` is then what this block needed. (The
    block's allocations then take fresh pages, as in a fresh process, which costs time.)

    Example::

        with PeakMemory() as memory:
            accelerator.save_state(path)
        print(memory.peak - memory.before, memory.anon_peak - memory.anon_before)
    """

    method = "VmHWM after clear_refs 5"

    def __init__(self, trim: bool = False, anonymous: bool = True) -> None:
        self.trim, self.anonymous = trim, anonymous
        self.before = self.peak = self.anon_before = self.anon_peak = 0
        self._exact = True
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "PeakMemory":
        if self.trim:
            return_free_heap()
        self.before = status_bytes("VmRSS")
        if self.anonymous:
            self.anon_before = self.anon_peak = status_bytes("RssAnon")
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            PeakMemory.method = "VmHWM after clear_refs 5"
        except OSError:
            PeakMemory.method = "VmRSS sampled every 2 ms"
            self._exact = False
        self.peak = self.before
        if self.anonymous or not self._exact:
            self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._take()

    def _take(self) -> None:
        if self.anonymous:
            self.anon_peak = max(self.anon_peak, status_bytes("RssAnon"))
        if not self._exact:
            self.peak = max(self.peak, status_bytes("VmRSS"))

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()
        if self._exact:
            self.peak = status_bytes("VmHWM")


# -- rounds -----------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key} {_describe(v)}" for key, v in value.items() if isinstance(v, (int, float)))
    return f"{value:.3f}s" if isinstance(value, (int, float)) else ""


def interleaved(contenders: Mapping[str, Callable[[], Any]], rounds: int, *, warmup: int = 1, rotate: bool = True,
                sync: Optional[Callable[[], None]] = None, say: Optional[Callable[[str], None]] = None,
                describe: Callable[[Any], str] = _describe) -> Dict[str, List[Any]]:
    """Each contender called ``warmup`` times (untimed, not returned), then ``rounds`` rounds in
    which each is called once, in an order rotated by one every round (``rotate=False``: the order
    given). Before every call `collect` and ``sync()``, untimed. A contender returns what it
    measured (seconds, a dict of named values, ...); one that returns None is timed here.
    ``say``: a progress line per call (``describe`` of its value). Returns each contender's values.

    Example:
        >>> order = []
        >>> got = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b") or 1.0}, 2)
        >>> order, got["b"]
        (['a', 'b', 'a', 'b', 'b', 'a'], [1.0, 1.0])
    """
    names = list(contenders)
    for name in names:
        if say and warmup:
            say(f"  warm-up {name}")
        for _ in range(warmup):
            _call(contenders[name], sync)
    samples: Dict[str, List[Any]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)] if rotate else names:
            value, seconds = _call(contenders[name], sync)
            samples[name].append(seconds if value is None else value)
            if say:
                say(f"  round {r} {name}: {describe(samples[name][-1])}")
    return samples


def repeated(fn: Callable[[], Any], rounds: int, warmup: int = 0) -> List[Any]:
    """`interleaved` with one contender: ``rounds`` values of ``fn`` (its seconds where it returns None)."""
    return interleaved({"": fn}, rounds, warmup=warmup)[""]


def columns(values: Iterable[Mapping[str, Any]]) -> Dict[str, List[Any]]:
    """Per-round dicts as one list per key: ``[{"save": 1}, {"save": 2}]`` -> ``{"save": [1, 2]}``."""
    out: Dict[str, List[Any]] = {}
    for value in values:
        for key, item in value.items():
            out.setdefault(key, []).append(item)
    return out


# -- statistics and tables --------------------------------------------------------------------------
def stats(values: Sequence[float]) -> Dict[str, float]:
    """min / median / max and spread (max / min) of ``values``.

    Example:
        >>> stats([2.0, 1.0, 4.0])
        {'min': 1.0, 'median': 2.0, 'max': 4.0, 'spread': 4.0}
    """
    low, high = min(values), max(values)
    return {"min": low, "median": statistics.median(values), "max": high,
            "spread": high / low if low > 0 else float("inf")}


def cells(values: Sequence[float], columns: str = "min median max", reference: Optional[float] = None, *,
          scale: float = 1.0, digits: int = 3, spread_digits: int = 1, ratio_digits: int = 3) -> List[str]:
    """The table cells of ``values``, one per word of ``columns``: ``min``, ``median``, ``max``
    (times ``scale``, ``digits`` decimals), ``min-max`` (both in one cell), ``range`` (max - min),
    ``spread`` (max / min, ``spread_digits``), ``ratio`` (the median against ``reference``, a
    median in the unit of ``values``, before ``scale``; ``ratio_digits``).

    Example:
        >>> cells([1.0, 1.2, 1.1], "min median max spread ratio", 1.1, scale=1e3, digits=1)
        ['1000.0', '1100.0', '1200.0', '1.2x', '1.000x']
    """
    s = stats(values)
    number = {name: f"{s[name] * scale:.{digits}f}" for name in ("min", "median", "max")}
    number.update({"min-max": f"{number['min']}-{number['max']}",
                   "range": f"{(s['max'] - s['min']) * scale:.{digits}f}",
                   "spread": f"{s['spread']:.{spread_digits}f}x"})
    if reference is not None:
        number["ratio"] = f"{s['median'] / reference:.{ratio_digits}f}x"
    return [number[name] for name in columns.split()]


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: ``align`` holds one letter per column, ``l`` (``---``) or ``r`` (``---:``).

    Example:
        >>> print(table(["loop", "median (ms)"], "lr", [["raw", "1.0"], ["", ""]]))
        | loop | median (ms) |
        |---|---:|
        | raw | 1.0 |
        | | |
    """
    if len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} letters for {len(header)} columns")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["|" + "|".join(f" {cell} " if str(cell) else " " for cell in row) + "|" for row in rows]
    return "\n".join(lines)


def command() -> str:
    """The command that produced this run, as typed from the repository root."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["python", "-m", spec.name] if spec else ["python", os.path.relpath(sys.argv[0], ROOT)]
    return " ".join(shlex.quote(word) for word in head + sys.argv[1:])


def print_command() -> None:
    """The first line of a benchmark's output: the command that produced its tables."""
    print(f"Command: `{command()}`\n", flush=True)


class Run:
    """The wall time and load of a run."""

    def __init__(self) -> None:
        self.started, self.load = time.perf_counter(), os.getloadavg()[0]

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def machine(self, settings: str) -> str:
        """The line above a run's tables: the machine, ``settings``, wall time and load average."""
        return (f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
                f"{settings}; wall time {self.elapsed():.0f} s; 1-min load average at start "
                f"{self.load:.2f}, at end {os.getloadavg()[0]:.2f} (other processes on this machine disturb the "
                "timings)\n")


# -- parts in processes of their own ----------------------------------------------------------------
class PartFailed(RuntimeError):
    """A part gave no result: the message holds its exit status and the end of its output."""


def emit(result: Any) -> None:
    """Print a part's result for its parent (in a launched group: on process 0 only)."""
    print(MARKER + json.dumps(result), flush=True)


def result_in(output: str) -> Optional[Any]:
    """The last result `emit` printed in ``output`` (a launched group's lines start with ``[0]``)."""
    found = [m.group(1) for m in map(re.compile(r"^(?:\[0\]\s*)?" + re.escape(MARKER) + r"(.*)$").match,
                                     output.splitlines()) if m]
    return json.loads(found[-1]) if found else None


def run_part(command: List[str], env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
             quiet: bool = False) -> Any:
    """``command`` run from the repository root (its stderr shown as it runs unless ``quiet``), and
    the result it `emit`-ted; `PartFailed` without one."""
    proc = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE if quiet else None, text=True, timeout=timeout)
    result = result_in(proc.stdout)
    if proc.returncode or result is None:
        raise PartFailed(f"exit code {proc.returncode}:\n{proc.stdout[-4000:]}\n{(proc.stderr or '')[-4000:]}".strip())
    return result


def module(name: str, *args: str) -> List[str]:
    """The command of ``python -m benchmarks.<name> args`` in this interpreter."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def run_launched(script: str, backend: str, worker_args: List[str], timeout: float,
                 processes: int = 2) -> Optional[dict]:
    """``unified launch -n 2 --backend B script --worker ...`` (``processes`` instead of 2);
    process 0's `emit`, with the group's wall time as ``wall_s``, or None (and the output on
    stderr) when there is none."""
    command = [sys.executable, "-m", "unified", "launch", "-n", str(processes), "--backend", backend,
               str(Path(script).resolve()), "--worker", *worker_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    (proc, wall) = clocked(lambda: subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True, timeout=timeout))
    result = result_in(proc.stdout)
    if result is None:
        sys.stderr.write(f"{backend}: no result (exit code {proc.returncode}); output:\n{proc.stdout}\n")
        return None
    return {**result, "wall_s": wall}


def launch_each(script: str, backends: str, worker_args: List[str], timeout: float,
                describe: Callable[[dict], str]) -> Optional[List[dict]]:
    """`run_launched` for each of the comma-separated ``backends``, a line per group on stderr
    (``describe(result)`` and its wall time); None as soon as one group gives no result."""
    results = []
    for backend in [b.strip() for b in backends.split(",") if b.strip()]:
        result = run_launched(script, backend, worker_args, timeout)
        if result is None:
            return None
        results.append(result)
        log(f"{backend}: {describe(result)}, {result['wall_s']:.1f} s")
    return results


def main_launched(doc: str, argv: Optional[List[str]], script: str, worker: Callable[[argparse.Namespace], None],
                  options: Mapping[str, Tuple[int, str]], timeout: float, describe: Callable[[dict], str],
                  show: Callable[[List[dict], bool], None]) -> int:
    """The main of a benchmark measured inside launched groups (collectives.py, loop.py), whose
    integer ``options`` (name -> default, help) the workers get: with ``--worker``, ``worker(args)``
    in each process; else a group per backend of ``--backends`` runs ``script`` (`launch_each`),
    and ``show(results, picture)`` prints the table and, unless ``--no-picture``, draws the picture."""
    from benchmarks import plot

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, (default, text) in options.items():
        parser.add_argument(f"--{name}", type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--backends", default="torch,jax", help="comma-separated (default torch,jax)")
    parser.add_argument("--group-timeout", type=float, default=timeout, help="seconds per backend run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    plot.add_option(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    print_command()
    results = launch_each(script, args.backends,
                          [word for name in options for word in (f"--{name}", str(getattr(args, name)))],
                          args.group_timeout, describe)
    if results is None:
        return 1
    show(results, not args.no_picture)
    return 0


@contextlib.contextmanager
def environment(**variables: str) -> Iterable[None]:
    """Environment variables set for the duration of a ``with`` block, then removed."""
    os.environ.update(variables)
    try:
        yield
    finally:
        for name in variables:
            os.environ.pop(name, None)
