"""The fresh memory a load reads into gets the pages the frameworks' own tensors get: NumPy asks
for transparent huge pages for every array of 4 MiB or more, torch and XLA ask for none, and on
this machine (a Firecracker VM) filling fresh huge pages made a
torch resume 2x slower than with ordinary pages, behind Accelerate's (docs/benchmarks/checkpoint.md)."""
from __future__ import annotations

import numpy as np
import pytest

from unified.checkpoint import safetensors_io


def _policy() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as handle:
            return handle.read()
    except OSError:
        return ""


def _eligible(array: np.ndarray) -> int:
    """smaps' ``THPeligible`` of the mapping that holds the middle of ``array``."""
    middle = array.ctypes.data + array.nbytes // 2
    with open("/proc/self/smaps") as handle:
        inside = False
        for line in handle:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= middle < high
            elif inside and head == "THPeligible:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the array")


pytestmark = pytest.mark.skipif("[madvise]" not in _policy(), reason="the kernel's huge-page policy is not 'madvise'")


def test_a_loads_fresh_arrays_ask_for_no_huge_pages_where_numpys_do():
    numpys = np.empty(64 << 20, np.uint8)
    ours = safetensors_io.private_array(np.dtype(np.float32), (16 << 20,))
    assert _eligible(numpys) == 1  # NumPy asked (what the test would miss if it stopped asking)
    assert _eligible(ours) == 0
    ours[:] = 1  # and the memory is ordinary, writable, aligned
    assert ours.ctypes.data % 64 == 0 and float(ours.sum()) == 16 << 20

