"""benchmarks/checkpoint.py's side-by-side table from a made-up result, and the runner's peak
memory on a real allocation (the report runs only after a long benchmark: a slip there loses the
run; a peak that misses memory makes the memory columns say nothing)."""
import time

import numpy as np
import pytest

from benchmarks import checkpoint as bench
from benchmarks import runner
from benchmarks.checkpointing import MEMORY_ANON, MEMORY_RSS


def _memory(rss_mb, anon_mb):
    return {f"save_state {MEMORY_RSS}": rss_mb[0] * 1e6, f"load_state {MEMORY_RSS}": rss_mb[1] * 1e6,
            f"save_state {MEMORY_ANON}": anon_mb[0] * 1e6, f"load_state {MEMORY_ANON}": anon_mb[1] * 1e6}


def test_every_contender_is_compared_with_the_raw_limit_with_its_peak_memory():
    res = {"framework": "torch", "samples": {
        "ours": {"save_state": [1.0, 2.0, 3.0], "load_state": [0.3, 0.2, 0.4]},
        "accelerate": {"save_state": [4.0, 4.0, 4.0], "load_state": [0.5, 0.5, 0.5]},
        "ours_async": {"async blocking": [0.01], "async wait": [1.0], "async total": [1.01]},
        "dcp": {"save_state": [3.0, 3.0, 3.0], "load_state": [0.6, 0.6, 0.6]},
        "raw": {"save_state": [1.0, 1.0, 1.0], "load_state": [0.1, 0.1, 0.1]}},
        "memory": {"ours": _memory((10, 1500), (5, 1400)), "dcp": _memory((0, 36), (0, 36))}}
    rows = {line.split(" | ")[1]: line for line in bench._side_by_side(res)[2:]}
    assert set(rows) == {"ours", "Accelerate", "torch DCP (FileSystemWriter)", "raw write / readinto (the limit)"}
    assert " | 2.000 | 1.000-3.000 | 2.00x | 0.300 | 0.200-0.400 | 3.00x | 10 / 1,500 | 5 / 1,400 |" in rows["ours"]
    assert ("| 3.000 | 3.000-3.000 | 3.00x | 0.600 | 0.600-0.600 | 6.00x | 0 / 36 | 0 / 36 |"
            in rows["torch DCP (FileSystemWriter)"])
    assert "| 1.00x |" in rows["raw write / readinto (the limit)"]


def test_peak_memory_sees_an_allocation_made_and_freed_inside_the_block():
    try:
        runner.status_bytes("RssAnon")
    except OSError:
        pytest.skip("needs /proc/self/status with RssAnon (Linux)")
    with runner.PeakMemory() as peak:
        block = np.ones(200 << 20, np.uint8)  # 200 MiB, touched
        time.sleep(0.2)  # the anonymous peak is sampled every 2 ms by a thread, which needs the GIL
        del block
    assert peak.peak - peak.before >= 150 << 20
    assert peak.anon_peak - peak.anon_before >= 150 << 20


def test_a_measured_call_reports_its_peak_beyond_the_live_state():
    try:
        runner.status_bytes("VmHWM")
    except OSError:
        pytest.skip("needs /proc/self/status (Linux)")
    got = runner.measured(lambda: np.ones(100 << 20, np.uint8).sum())  # 100 MiB, freed before it returns
    assert got["s"] > 0 and runner.beyond(got) >= 80 << 20


def test_a_resume_is_judged_by_issue_48s_measures():
    def resume(medians, peak_mb):
        names = {bench.RESUME[key]: [value * 0.9, value, value * 1.2] for key, value in medians.items()}
        return {"samples": names, "peaks": {name: [peak_mb * 1e6] * 3 for name in names}, "bytes": 1.5e9,
                "peer_versions": {"fastsafetensors": "0.5.0"}}

    results = [{"framework": "torch", "resume": resume({"floor": 0.50, "warm": 0.27, "ours": 0.54, "accelerate": 0.65,
                                                        "runai": 0.70, "fastsafetensors": 0.60}, 1)},
               {"framework": "jax", "resume": resume({"floor": 0.40, "warm": 0.27, "ours": 0.58, "orbax": 0.60,
                                                      "orbax_uncompressed": 0.50, "fastsafetensors": 0.55}, 300)}]
    rows = bench._resume_verdict(results)[2:]
    torch_rows = {line.split(" | ")[1]: line for line in rows if line.startswith("| torch")}
    jax_rows = {line.split(" | ")[1]: line for line in rows if line.startswith("| jax")}
    assert torch_rows["ours / raw floor (median)"].endswith("| 1.08x | <= 1.1x | yes |")
    assert torch_rows[f"{bench.RESUME['accelerate']} / ours (speed-up)"].endswith("| 1.20x | >= 1.1x | yes |")
    assert torch_rows[f"fastest peer: {bench.RESUME['fastsafetensors']} / ours (speed-up)"].endswith(
        "| 1.11x | > 1x | yes |")
    assert jax_rows["ours / raw floor (median)"].endswith("| 1.45x | <= 1.1x | **NO** |")
    assert jax_rows[f"{bench.RESUME['orbax']} / ours (speed-up)"].endswith("| 1.03x | >= 1.1x | **NO** |")
    assert jax_rows[f"{bench.RESUME['orbax_uncompressed']} / ours (speed-up)"].endswith("| 0.86x | | |")
    assert jax_rows[f"fastest peer: {bench.RESUME['fastsafetensors']} / ours (speed-up)"].endswith("| **NO** |")
    assert jax_rows["ours: peak RSS beyond the live state, worst round (MB)"].endswith("| 300 | | | <= 256 | **NO** |")
    table = bench._load_table(results, "resume")
    ours = next(line for line in table if line.startswith("| torch (1.50 GB) | ours |"))
    assert "| 3 | 0.486 | 0.540 | 0.648 | 1.3x | 1.08x | 2.00x | 1 (1) |" in ours
    assert any('{"fastsafetensors": "0.5.0"}' in line for line in table)
