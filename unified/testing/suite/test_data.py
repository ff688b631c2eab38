"""Conformance: sharded data, batch skipping and mid-epoch resume, in groups of 2 and 3; the group
of 2 goes on with the libraries' loaders (torchdata, Hugging Face streams, Grain, torch iterable
datasets with workers) and the experiment trackers (process start-up is the expensive part)."""
from __future__ import annotations

import importlib.util
import os
from typing import Dict

import pytest

from unified.tracking import available_trackers

from ..data_scenarios import (
    TRACKED_STEPS,
    data_dispatch,
    data_epochs,
    data_iterable,
    data_load_other_count,
    data_resume,
    data_save_for_other_count,
    data_skip,
    data_split_dispatch,
    data_torch_workers,
    data_uneven,
    tracking,
)
from ..harness import GroupResult, run_group
from ..pipeline_scenarios import (
    HF_SHARDS,
    TORCH_STREAM,
    hf_total,
    pipeline_grain,
    pipeline_hf_stream,
    pipeline_torch_stream,
    pipeline_torchdata,
)
from ..scenarios import start
from ..tracker_files import READER_MODULES, READERS

pytestmark = pytest.mark.multiprocess
# unified's own sharding, skipping and resume: in the groups of 2 and of 3 (uneven shares)
CORE = [start, data_epochs, data_skip, data_resume, data_torch_workers, data_iterable, data_dispatch,
        data_uneven, data_split_dispatch]
# the libraries' loaders and the trackers: in the group of 2 only. What they add is the library's side
# (its workers, its state), which does not depend on the process count that CORE checks at 2 and 3;
# and they are the costly part of a group (each Grain loader starts its worker processes).
LIBRARIES = [pipeline_torchdata, pipeline_hf_stream, pipeline_grain, pipeline_torch_stream, tracking]
# Accelerate 1.15's DataLoaderDispatcher, 13 items, batch_size=2: each process's batches ("|" between
# batches, "/" between processes), as tests/unit/test_dispatch_batches.py holds them
ACCELERATE_DISPATCH = {2: "0 1|4 5|8 9|12 / 2 3|6 7|10 11|0", 3: "0 1|6 7|12 / 2 3|8 9|0 / 4 5|10 11|1"}
# Measured on Accelerate 1.15.0 (torchrun, 2 and 3 CPU processes on gloo, ACCELERATE_USE_CPU=1), 13 items
# (a map-style dataset whose item i is [i]) in a torch DataLoader, shuffle off, written the same way:
# DataLoaderConfiguration(even_batches=False), batch_size=2 (DataLoaderShard over BatchSamplerShard: the
# last global batch left short, no repeats; len() per process 4, 3 and 3, 2, 2)
ACCELERATE_UNEVEN = {2: "0 1|4 5|8 9|12 / 2 3|6 7|10 11", 3: "0 1|6 7|12 / 2 3|8 9 / 4 5|10 11"}
# DataLoaderConfiguration(dispatch_batches=True, split_batches=True), batch_size=6 (DataLoaderDispatcher:
# process 0 reads one batch a step, every process gets its slice; the last step filled up with the
# epoch's first rows; len() 3; gather_for_metrics gives 0..12 once)
ACCELERATE_SPLIT_DISPATCH = {2: "0 1 2|6 7 8|12 / 3 4 5|9 10 11|0", 3: "0 1|6 7|12 / 2 3|8 9|0 / 4 5|10 11|1"}


@pytest.fixture(scope="module")
def groups(backend) -> Dict[int, GroupResult]:
    """The groups run so far for this backend, by size (each runs once, whichever test needs it first)."""
    return {}


def _group(groups: Dict[int, GroupResult], backend: str, size: int, tmp_path_factory) -> GroupResult:
    if size not in groups:
        scenarios = CORE + LIBRARIES if size == 2 else CORE
        groups[size] = run_group(backend, size, scenarios, tmp_path_factory.mktemp("data")).ok()
    return groups[size]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-processes")
def group(request, backend, groups, tmp_path_factory):
    return _group(groups, backend, request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def pair(backend, groups, tmp_path_factory):
    """The group of 2, which also ran the libraries' loaders and the trackers."""
    return _group(groups, backend, 2, tmp_path_factory)


def _global(rows_per_process, batch):
    return [x for rows in rows_per_process for x in rows[batch]]


def _epoch_sequence(results, epoch, padding):
    batches = len(results[0]["epochs"][epoch])
    sequence = []
    for k in range(batches):
        full = _global([r["epochs"][epoch] for r in results], k)
        sequence += full[: len(full) - padding[k]]
    return sequence


def test_each_sample_once_per_epoch_and_epochs_differ(group):
    results = group.scenario(data_epochs)
    padding = results[0]["padding"]
    e0, e1 = (_epoch_sequence(results, e, padding) for e in (0, 1))
    assert sorted(e0) == list(range(10)) and sorted(e1) == list(range(10))
    assert e0 != e1
    # gather of a prepared batch is the global batch in process order, on both backends
    assert all(r["gathered"] == [x for q in results for x in q["first_rows"]] for r in results)
    assert all(r["reduced"] == group.size for r in results)


def test_same_seed_same_order_at_any_process_count(group):
    results = group.scenario(data_epochs)
    order = _epoch_sequence(results, 0, results[0]["padding"])
    # the same global order at 2 and 3 processes: both equal the definition from (seed, epoch)
    from unified.data import ShuffledOrder

    assert order == ShuffledOrder(10, 5, 0).tolist()


def test_skip_first_batches_loads_nothing_skipped_and_shares_the_epoch(group):
    for r in group.scenario(data_skip):
        ref = r["ref"]
        assert r["first"] == ref[0]
        assert r["skipped"] == ref[1][2:]
        assert r["calls"] == len(r["skipped"]) * r["batch_size"]  # only the yielded batches were loaded
        assert r["after"] == ref[2]


def test_mid_epoch_resume_with_and_without_manual_skip(group):
    for r in group.scenario(data_resume):
        assert r["resumed"] == r["expected"]
        assert r["resumed_with_skip"] == r["expected"]
        assert r["seen_prefetch"] == r["seen"]  # unified.DataLoader(prefetch=3): the same batches...
        assert r["resumed_prefetch"] == r["expected"]  # ...and a resume at the first one not received


def test_torch_worker_processes_keep_order_and_skipping(group):
    for r in group.scenario(data_torch_workers):
        assert r["epochs"] == r["ref"]
        assert r["skipped_rows"] == r["ref_epoch2"][1:]


def test_resume_with_another_process_count_continues_at_the_same_sample(backend, tmp_path):
    saved = run_group(backend, 2, [start, data_save_for_other_count], tmp_path).ok()
    loaded = run_group(backend, 3, [start, data_load_other_count], tmp_path).ok()
    order = saved.scenario(data_save_for_other_count)[0]["order"]
    rows = loaded.scenario(data_load_other_count)
    assert all(r["position"] == 0 for r in rows)  # the epoch was finished by iterating it
    rest = [x for k in range(len(rows[0]["rest"])) for x in _global([r["rest"] for r in rows], k)]
    assert rest == order[12:]


def test_iterable_data_sharded_skipped_on_host_and_resumed_from_state(group):
    rows = group.scenario(data_iterable)
    g = 2 * group.size
    full, left = divmod(20, g)
    for r in rows:
        # the stream's incomplete end is a last batch filled up with its own items (drop_last=False)
        assert len(r["epoch0"]) == full + (left > 0)
        assert len(r["epoch0_drop_last"]) == full and r["epoch0_drop_last"] == r["epoch0"][:full]
        assert r["skipped"] == r["epoch0"][2:]          # the next epoch, from batch 2
        assert r["read_to_skip"] == 2 * g               # read and dropped on the host
        assert r["resumed"] == r["rest"]                # continued from the dataset's own state
        assert r["resumed_reads"] == 20 - 2 * g         # nothing read twice
    seen = sorted(x for r in rows for batch in r["epoch0"][:full] for x in batch)
    assert seen == list(range(full * g))                # every process its own share, once
    last = [x for r in rows for x in r["epoch0"][full:][0]] if left else []
    assert sorted(set(last)) == list(range(full * g, 20))  # the end: its items, repeated to fill up


def test_dispatch_batches_gives_accelerates_batches_and_resumes_exactly(group):
    """DataLoaderConfiguration(dispatch_batches=True): only process 0 reads; every process gets its
    rows of each step as in Accelerate; a mid-epoch checkpoint resumes with exactly the rest. A
    backend whose step batches are one global array refuses it, naming its own way."""
    rows = group.scenario(data_dispatch)
    if rows[0]["global_arrays"]:
        for r in rows:
            assert "dispatch_batches=True" in r["refused"] and "dispatch-batches-jax" in r["refused"], r
        return
    expected = [[[int(x) for x in b.split()] for b in p.split("|")]
                for p in ACCELERATE_DISPATCH[group.size].split(" / ")]
    n = group.size
    for rank, r in enumerate(rows):
        assert "refused" not in r, r
        assert r["epoch"] == r["streamed"] + r["rest"][:len(r["epoch"]) - 2] == expected[rank]
        assert r["length"] == len(expected[rank])
        assert r["gathered"] == list(range(13))  # gather_for_metrics drops the rows that fill up the last step
        assert r["resumed"] == r["rest"] == expected[rank][2:] + expected[rank]
        assert r["map_resumed"] == r["map_rest"] == expected[rank][2:]
        # only process 0 reads: the resumed stream from its own state, nothing read twice
        assert (r["reads"] > 0, r["resumed_reads"]) == ((True, 26 - 4 * n) if rank == 0 else (False, 0))


def _batches(table, size):
    return [[[int(x) for x in b.split()] for b in p.split("|") if b.strip()] for p in table[size].split(" / ")]


def test_even_batches_false_gives_accelerates_short_last_batches_and_resumes_exactly(group):
    """DataLoaderConfiguration(even_batches=False), every process reading its own batches: each
    gets Accelerate's batches (the last one short, or none), for unified's loader and a torch
    DataLoader; a mid-epoch checkpoint resumes with exactly the rest. A backend whose step batches
    are one global array refuses it in prepare, saying to keep even_batches=True."""
    rows = group.scenario(data_uneven)
    if rows[0]["global_arrays"]:
        for r in rows:
            for key in ("", "torch_") if "torch_error" in r else ("",):  # (a backend may prepare no torch loader)
                assert r[key + "error"] == "NotImplementedError", r
                assert "DataLoaderConfiguration(even_batches=False) is not supported" in r[key + "refused"], r
                assert "Keep even_batches=True" in r[key + "refused"], r
        return
    expected = _batches(ACCELERATE_UNEVEN, group.size)
    for rank, r in enumerate(rows):
        assert "refused" not in r, r
        assert r["epoch"] == expected[rank] and r["length"] == len(expected[rank]), r
        if r["torch_epoch"] is not None:  # (None: a backend that prepares no torch DataLoader)
            assert r["torch_epoch"] == expected[rank] and r["torch_length"] == len(expected[rank]), r
        # saved after 2 batches: in the group of 3, processes 1 and 2 have had all of theirs, and the rest of
        # the epoch is no batch for them (as Accelerate's skip_first_batches(loader, 2), measured: []), then
        # the next epoch, in the same iteration as process 0's
        assert r["resumed"] == r["rest"] == r["resumed_with_skip"] == expected[rank][2:] + expected[rank]


def test_split_batches_with_dispatch_gives_accelerates_slices_and_resumes_exactly(group):
    """DataLoaderConfiguration(dispatch_batches=True, split_batches=True): process 0 reads one batch
    of the loader a step and every process gets Accelerate's slice of it, for unified's loader and a
    torch DataLoader; a mid-epoch checkpoint resumes with exactly the rest, not reading the step it skips; a
    batch size that does not divide by the processes is Accelerate's ValueError. A backend whose step
    batches are one global array refuses dispatch, naming its own way."""
    rows = group.scenario(data_split_dispatch)
    if rows[0]["global_arrays"]:
        for r in rows:
            assert r["error"] == "NotImplementedError", r
            assert "dispatch_batches=True" in r["refused"] and "dispatch-batches-jax" in r["refused"], r
            assert "Leave dispatch_batches unset" in r["refused"], r
        return
    expected = _batches(ACCELERATE_SPLIT_DISPATCH, group.size)
    for rank, r in enumerate(rows):
        assert "refused" not in r, r
        assert r["epoch"] == expected[rank] and r["length"] == 3, r  # the loader's own length
        if r["torch_epoch"] is not None:  # (None: a backend that prepares no torch DataLoader)
            assert r["torch_epoch"] == expected[rank] and r["torch_length"] == 3, r
        assert r["gathered"] == list(range(13))  # gather_for_metrics drops the rows that fill up the last step
        # Accelerate 1.15's property raises AttributeError here (it reads batch_size from the dataset)
        assert r["total_batch_size"] == 6
        assert r["resumed"] == r["rest"] == expected[rank][1:] + expected[rank]
        # only process 0 reads, 18 items an epoch: the loader's own last batch, [12], is read in its one-process
        # form, [12 0 1 2 3 4], and cut (as tests/unit/test_dispatch_batches.py says; Accelerate reads [12]).
        # Resumed after one step of 6: the skipped step is not read again
        assert (r["reads"] > 0, r["resumed_reads"]) == ((True, 18 - 6 + 18) if rank == 0 else (False, 0))
        error, message = r["indivisible"]  # Accelerate's type and message, then unified's troubleshooting link
        assert error == "ValueError" and message.startswith(
            "To use a `DataLoader` in `split_batches` mode, the batch size (5) needs to be a round multiple of the "
            f"number of processes ({group.size}).") and "dispatch-batch-types" in message, r


def _pipeline(group, scenario):
    rows = group.scenario(scenario)
    if "missing" in rows[0]:
        pytest.skip(rows[0]["missing"])
    return rows


@pytest.mark.parametrize("scenario, samples", [pytest.param(pipeline_torchdata, 24, id="torchdata"),
                                               pytest.param(pipeline_hf_stream, hf_total(), id="datasets-stream"),
                                               pytest.param(pipeline_grain, 30, id="grain")])
def test_library_pipelines_give_each_process_its_share_and_resume_exactly(pair, scenario, samples):
    rows = _pipeline(pair, scenario)
    # repeats that fill up a batch are a process's own
    shares = [{x for batch in r["epoch"] for x in batch} for r in rows]
    assert sum(len(s) for s in shares) == len(set().union(*shares)) == samples  # disjoint, together the whole epoch
    for r in rows:
        assert sorted(r["metrics"]) == list(range(samples))  # gather_for_metrics: every sample once
        assert len(r["first"]) == 2 and r["rest"]
        assert r["resumed"] == r["rest"]  # a fresh Accelerator continues at the next batch of every process


@pytest.mark.parametrize("kind", ["split", "whole"])
def test_a_torch_iterable_dataset_with_workers_gives_each_process_its_share_and_resumes_exactly(pair, kind):
    """Every DataLoader worker of every process is one reader: a dataset that splits by its worker
    info reads 1/P of the stream per process; one that does not is read whole once per process,
    which keeps its own blocks. Either way the shares are disjoint and resume exactly."""
    rows = _pipeline(pair, pipeline_torch_stream)
    results = [r[kind] for r in rows]
    shares = [{x for batch in r["epoch"] for x in batch} for r in results]
    assert sum(len(s) for s in shares) == len(set().union(*shares)) == TORCH_STREAM
    for r in results:
        assert sorted(r["metrics"]) == list(range(TORCH_STREAM))
        assert len(r["first"]) == 2 and r["rest"] and r["resumed"] == r["rest"]
    reads = [r["reads"] for r in results]
    # whole: worker 0 of each process reads it all, worker 1 one item (to see that it does not split)
    expected = TORCH_STREAM // pair.size if kind == "split" else TORCH_STREAM + 1
    assert reads == [expected] * pair.size


def test_a_datasets_stream_is_read_one_share_per_process(pair):
    rows = _pipeline(pair, pipeline_hf_stream)
    opened = [r["shards_read"] for r in rows]
    assert sorted(s for shards in opened for s in shards) == list(range(HF_SHARDS))  # each shard once, by one process
    assert all(len(shards) == HF_SHARDS // pair.size for shards in opened)
    lengths = [len(r["epoch"]) for r in rows]
    assert len(set(lengths)) == 1  # shares of unequal length: every process takes part in every step


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow", "wandb"])
def test_trackers_write_on_the_main_process_only_and_end_training_closes_them(pair, tracker):
    if tracker not in available_trackers() or importlib.util.find_spec(READER_MODULES[tracker]) is None:
        pytest.skip(f"needs the tracking extra (and {READER_MODULES[tracker]} to read): "
                    "pip install 'unified[tracking,test]'")
    main, *others = pair.scenario(tracking)
    assert tracker in main["started"] and main["after_end"] == [], main
    assert main["handles"][tracker] == {"tensorboard": "SummaryWriter", "mlflow": "ActiveRun", "wandb": "Run"}[tracker]
    assert all(main["framework_arrays"]), "the scenario logged the backend's own 0-d arrays"
    assert main["writer_closed"]
    for other in others:  # no tracker, no tracker package, get_tracker a no-op
        assert other["started"] == [] and other["imported"] == [], other
        assert other["wrapped"][tracker] == "NoOpTracker" and other["handles"][tracker] == "NoOpTracker", other
    # tensorboardX imports torch when it can: not in a process that had not (a JAX run)
    assert main["frameworks_after"] == main["frameworks_before"], main

    logging_dir = pair.shared / "tracking"
    found = READERS[tracker](logging_dir, "conformance")
    assert found["runs"] == 1, f"expected one run, written by process 0 only: {found}"
    n = pair.size
    steps = range(1, TRACKED_STEPS + 1)
    assert [step for step, _ in found["scalars"]["loss"]] == list(steps)
    assert [value for _, value in found["scalars"]["loss"]] == pytest.approx([1.0 / s for s in steps])
    assert found["scalars"]["reduced"] == [(s, float(s * n)) for s in steps]  # a framework 0-d array, summed
    assert found["scalars"]["count"] == [(s, 10.0 * s) for s in steps]
    assert found["config"]["lr"] == "0.5" and "tiny" in found["config"]["name"]
    assert found["closed"] in (True, None)  # None: event files do not record it (checked by writer_closed)
    if tracker == "tensorboard":
        assert found["hparam_files"] == 1
    # Nothing else in the logging directory: the three trackers' own entries.
    assert set(os.listdir(logging_dir)) <= {"conformance", "mlflow.db", "mlartifacts", "mlruns", "wandb"}
