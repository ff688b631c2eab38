"""benchmarks/checkpoint.py's side-by-side table from a made-up result, and benchmarks/memory.py's
peak memory on a real allocation (the report runs only after a long benchmark: a slip there loses
the run; a peak that misses memory makes the memory columns say nothing)."""
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)  # stdlib imports only: the frameworks load in the parts
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def _memory(bench, rss_mb, anon_mb):
    return {f"save_state {bench.MEMORY_RSS}": rss_mb[0] * 1e6, f"load_state {bench.MEMORY_RSS}": rss_mb[1] * 1e6,
            f"save_state {bench.MEMORY_ANON}": anon_mb[0] * 1e6, f"load_state {bench.MEMORY_ANON}": anon_mb[1] * 1e6}


def test_every_contender_is_compared_with_the_raw_limit_with_its_peak_memory():
    bench = _module("checkpoint")
    res = {"framework": "torch", "samples": {
        "ours": {"save_state": [1.0, 2.0, 3.0], "load_state": [0.3, 0.2, 0.4]},
        "accelerate": {"save_state": [4.0, 4.0, 4.0], "load_state": [0.5, 0.5, 0.5]},
        "ours_async": {"async blocking": [0.01], "async wait": [1.0], "async total": [1.01]},
        "dcp": {"save_state": [3.0, 3.0, 3.0], "load_state": [0.6, 0.6, 0.6]},
        "raw": {"save_state": [1.0, 1.0, 1.0], "load_state": [0.1, 0.1, 0.1]}},
        "memory": {"ours": _memory(bench, (10, 1500), (5, 1400)), "dcp": _memory(bench, (0, 36), (0, 36))}}
    rows = {line.split(" | ")[1]: line for line in bench._side_by_side(res)[2:]}
    assert set(rows) == {"ours", "Accelerate", "torch DCP (FileSystemWriter)", "raw write / readinto (the limit)"}
    assert " | 2.000 | 1.000-3.000 | 2.00x | 0.300 | 0.200-0.400 | 3.00x | 10 / 1,500 | 5 / 1,400 |" in rows["ours"]
    assert "| 3.000 | 3.000-3.000 | 3.00x | 0.600 | 0.600-0.600 | 6.00x | 0 / 36 | 0 / 36 |" in rows["torch DCP (FileSystemWriter)"]
    assert "| 1.00x |" in rows["raw write / readinto (the limit)"]


def test_peak_memory_sees_an_allocation_made_and_freed_inside_the_block():
    memory = _module("memory")
    try:
        memory.status_bytes("RssAnon")
    except OSError:
        pytest.skip("needs /proc/self/status with RssAnon (Linux)")
    with memory.PeakMemory() as peak:
        block = np.ones(200 << 20, np.uint8)  # 200 MiB, touched
        time.sleep(0.2)  # the anonymous peak is sampled every 2 ms by a thread, which needs the GIL
        del block
    assert peak.peak - peak.before >= 150 << 20
    assert peak.anon_peak - peak.anon_before >= 150 << 20
