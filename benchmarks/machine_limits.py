"""What this machine allows a load: copies out of the page cache, first touch of fresh memory, xxh3.

A checkpoint load can be no faster than the copies it must make, so these are the floors that
docs/benchmarks/checkpoint.md compares a resume with (its section "how far the resume can go"):

* ``preadv`` of files out of the page cache, by 1-4 threads, into a small reused buffer (as a
  verifying pass reads) and into warm memory of the files' size (as a read into live arrays);
* the first touch of 1 GiB of fresh anonymous memory (ordinary 4 KiB pages, as torch's and
  XLA's allocators get), by 1 and 2 threads, each in a fresh process;
* xxh3 of data in the CPU cache and in memory.

Usage (from the repository root; the files go to a fresh temporary folder unless ``--dir``
names a checkpoint folder whose ``*.safetensors`` files are read instead)::

    python -m benchmarks.machine_limits --size-gb 1.5 --rounds 5
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import mmap
import os
import shutil
import statistics
import tempfile
from typing import Callable, List

import numpy as np
import xxhash

from benchmarks.runner import cells, clocked, emit, module, print_command, repeated, run_part

CHUNK = 4 << 20


def _files(args: argparse.Namespace) -> List[str]:
    if args.dir:
        return [os.path.join(args.dir, n) for n in sorted(os.listdir(args.dir)) if n.endswith(".safetensors")]
    folder = tempfile.mkdtemp(prefix="unified-limits-")
    total = int(args.size_gb * 1e9)
    paths = []
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    for name, share in (("a.bin", total // 3), ("b.bin", total - total // 3)):  # a model's and an optimizer's
        path = os.path.join(folder, name)
        with open(path, "wb") as handle:
            for at in range(0, share, len(block)):
                handle.write(block[:min(len(block), share - at)])
        paths.append(path)
    return paths


def _copy(files: List[str], threads: int, into_warm: bool, warm: List[np.ndarray]) -> float:
    sizes = [os.path.getsize(f) for f in files]
    jobs = [(i, at) for i, size in enumerate(sizes) for at in range(0, size, CHUNK)]
    fds = [os.open(f, os.O_RDONLY) for f in files]
    rings = [memoryview(bytearray(CHUNK)) for _ in range(threads)]

    def work(k: int) -> None:
        for i, at in jobs[k::threads]:
            n = min(CHUNK, sizes[i] - at)
            os.preadv(fds[i], [memoryview(warm[i])[at:at + n] if into_warm else rings[k][:n]], at)

    took = clocked(_on_threads, work, threads)[1]
    for fd in fds:
        os.close(fd)
    return took


def _fresh_touch(threads: int) -> float:
    """Run in a fresh process: first touch of 1 GiB by ``threads`` threads, one byte per page."""
    size = 1 << 30
    memory = np.frombuffer(mmap.mmap(-1, size), np.uint8)

    def touch(k: int) -> None:
        memory[k * size // threads:(k + 1) * size // threads][::4096] = 1

    return clocked(_on_threads, touch, threads)[1]


def _on_threads(work: Callable[[int], None], threads: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))


def _row(what: str, samples: List[float], nbytes: int = 0) -> str:
    low, median, high = cells(samples)
    rate = f" ({nbytes / statistics.median(samples) / 1e9:.1f} GB/s)" if nbytes else ""
    return f"| {what} | {low} | {median}{rate} | {high} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.5, help="bytes of the files made (without --dir)")
    parser.add_argument("--dir", help="read this folder's *.safetensors files instead")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fresh-touch", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.fresh_touch:
        emit(_fresh_touch(args.fresh_touch))
        return
    print_command()
    files = _files(args)
    try:
        total = sum(os.path.getsize(f) for f in files)
        warm = [np.ones(os.path.getsize(f), np.uint8) for f in files]
        _copy(files, 1, False, warm)  # into the page cache
        rows = [f"{len(files)} files, {total / 1e9:.2f} GB, {os.cpu_count()} CPUs; {args.rounds} rounds",
                "", "| what | min (s) | median (s) | max (s) |", "|---|---:|---:|---:|"]
        for into_warm in (False, True):
            for threads in (1, 2, 3, 4):
                samples = repeated(functools.partial(_copy, files, threads, into_warm, warm), args.rounds)
                where = "warm memory of the files' size" if into_warm else "a small reused buffer"
                rows.append(_row(f"preadv out of the page cache into {where}, {threads} thread(s)", samples, total))
        for threads in (1, 2):
            command = module("machine_limits", "--fresh-touch", str(threads))
            samples = repeated(functools.partial(run_part, command), args.rounds)
            rows.append(_row(f"first touch of 1 GiB of fresh memory, {threads} thread(s), fresh process", samples))
        hot = np.random.default_rng(1).integers(0, 255, CHUNK, dtype=np.uint8)
        cold = max(warm, key=lambda array: array.nbytes)
        def hash_hot() -> None:
            for _ in range(64):
                xxhash.xxh3_64(memoryview(hot)).digest()

        rows.append(_row("xxh3 of 4 MiB in the CPU cache, 64 times", repeated(hash_hot, args.rounds), 64 * CHUNK))
        rows.append(_row("xxh3 of the largest file's bytes in memory",
                         repeated(lambda: [xxhash.xxh3_64(memoryview(cold)).digest()].clear(), args.rounds),
                         cold.nbytes))
        print("\n".join(rows))
    finally:
        if not args.dir:
            shutil.rmtree(os.path.dirname(files[0]), ignore_errors=True)


if __name__ == "__main__":
    main()
