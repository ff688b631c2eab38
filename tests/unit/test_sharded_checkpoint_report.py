"""The report of benchmarks/sharded_checkpoint.py from a made-up result of its process groups: a
round's time is its slowest process's, the goal column compares ours with the raw contenders only,
and every table renders (the report runs only after a long benchmark: a slip there loses the run)."""
from benchmarks import runner, sharded_checkpoint


def _script():
    return sharded_checkpoint  # the frameworks load in the workers


def _call(seconds, before=1.0e9, peak=1.5e9):
    return {"s": seconds, "rss_before": before, "rss_peak": peak}


def _process(ours, dcp, own=0.5e9):
    """One process of a torch group: ours and raw DCP, 2 rounds each, seconds per round."""
    samples = {"ours": {"save": [_call(s) for s in ours], "load": [_call(s) for s in ours]},
               "dcp": {"save": [_call(s, peak=1.0e9) for s in dcp], "load": [_call(s) for s in dcp]}}
    return {"samples": samples, "disk": {"ours": {"files": 3, "apparent": 10, "allocated": 12}},
            "own_bytes": own, "state_bytes": 1.0e9, "layers": 2, "hidden": 8, "versions": {"torch": "x"},
            "accelerate_skipped": "it does not run here", "reshard_loads": [_call(1.0), _call(1.2)],
            "profile": {"save: total (save_state)": 0.5}}


def test_rounds_take_the_slowest_process_and_the_goal_is_against_raw_contenders_only():
    bench = _script()
    processes = [_process([1.0, 3.0], [1.0, 1.0]), _process([2.0, 2.5], [0.5, 2.0])]
    assert bench.per_round(processes, lambda p: p["samples"]["ours"]["save"]) == [2.0, 3.0]
    assert runner.stats([2.0, 3.0]) == {"min": 2.0, "median": 2.5, "max": 3.0, "spread": 1.5}
    assert bench.verdict("torch", "dcp", 1.1) == "<= 1.1x: yes"
    assert bench.verdict("torch", "dcp_safetensors", 1.2) == "<= 1.1x: NO"
    assert bench.verdict("jax", "orbax", 0.9).endswith("yes")
    assert bench.verdict("jax", "orbax_uncompressed", 3.0) == ""  # for information
    assert bench.verdict("torch", "accelerate", 0.8) == "< 1x: yes"

    results = {"torch": {"bench": {"processes": processes, "rss_method": "VmHWM after clear_refs 5"},
                         "load3": {"processes": [{"reshard_loads": [_call(2.0), _call(2.4)]}] * 3}}}
    text = bench.report(results)
    # ours: rounds 2.0 and 3.0 (median 2.5); dcp: rounds 1.0 and 2.0 (median 1.5): 1.67x, goal missed
    assert "| torch | save_state | dcp | 2 | 1.000 | 1.500 | 2.000 | 2.00x | 1.67x | <= 1.1x: NO |" in text
    assert "| torch | save_state | ours | 2 | 2.000 | 2.500 | 3.000 | 1.50x | 1.00x | |" in text
    # memory: growth 0.5 GB against a 0.5 GB shard; the reshard row against 2 -> 2
    assert "| torch | ours | 0 | 0.500 | 1.000 | 1.000 | 1.500 | 0.500 | 1.00 |" in text
    assert "| torch | 2 -> 3 (ours) | 2 | 2.000 | 2.200 | 2.400 | 1.20x | 2.00x |" in text
    assert "no Accelerate column: it does not run here" in text
    groups = bench.picture(results)
    assert groups["torch save"] == {"ours": [2.0, 3.0], "dcp": [1.0, 2.0]}
    assert groups["torch load 2->2 | 2->3"] == {"ours": [1.0, 1.2], "ours 2->3": [2.0, 2.4]}
