"""Peak memory of this process during a block of code, from /proc/self (Linux).

Used by checkpoint.py, sharded_checkpoint.py, store_checkpoint.py and gpu_check.py (benchmarks/
is not a package: they put this folder and the repository's root on ``sys.path``)::

    with PeakMemory() as memory:
        accelerator.save_state(path)
    print(memory.peak - memory.before, memory.anon_peak - memory.anon_before)
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from unified.libc import return_free_heap  # the repository's root is on sys.path (see above)

__all__ = ["PeakMemory", "status_bytes"]


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``), in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


class PeakMemory:
    """The peak resident memory during a ``with`` block, in bytes after it:

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
    block's allocations then take fresh pages, as in a fresh process.)
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
