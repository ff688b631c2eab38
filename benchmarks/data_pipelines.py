"""Data pipelines (issue 28): reads per process, resume at position 100,000, per-batch cost.

Run from the repository root (needs `pip install -e '.[torch,data,torchdata,bench]'`):

    python -m benchmarks.data_pipelines [--rounds 5] [--position 100000] [--batches 1500] [--parts reads,resume,cost]

Prints three markdown tables (docs/benchmarks/data-pipelines.md holds a run of them):

1. Items read per process from a Hugging Face ``datasets.IterableDataset`` of 12 shards x 2,000
   items, for P = 2 and 3, counted by the generator itself (every item it yields): ours (the
   share `prepare` makes each process read: `unified.streams.HuggingFaceStream`), Accelerate 1.15
   (``accelerate.data_loader.prepare_data_loader(loader, num_processes=P, process_index=r)``), the
   library alone (``split_dataset_by_node``, the limit); then a torch ``IterableDataset`` of the
   same 12 shards in a ``DataLoader`` with 2 workers (counted in a counter the workers share):
   ours and Accelerate's when it splits its shards by ``get_worker_info()``, ours when it does
   not; and ours over a stream that is not a ``datasets`` one without workers (read whole by
   every process, as Accelerate does).
2. Resume at position ``--position`` (time from a fresh loader to its first batch, one process,
   ``--rounds`` rounds, min / median / max; `runner.interleaved`, no warm-up): for a torchdata
   ``StatefulDataLoader(shuffle=True)`` over map-style data, a ``datasets`` stream and a Grain
   ``DataLoader``: ours (a fresh Accelerator, ``prepare``, ``load_state`` of a checkpoint taken
   there, first batch), the library's own state (``load_state_dict`` / ``set_state``, first
   batch), and Accelerate's ``skip_first_batches`` on the same loader (torch loaders; Grain:
   reading and dropping, which is what skipping a loader without state is).
3. Per-batch cost of a prepared loader against the same library loader alone (one process,
   ``--batches`` batches of 32 rows, workers on where the library has them; rounds alternate
   the order, no warm-up): medians of per-epoch time, ratio ours / alone (goal: within 1.03x), and peak RSS.
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import resource
import statistics
import tempfile
import types
import warnings
from typing import Any, Callable, Dict, List

import numpy as np

from benchmarks.runner import cells, interleaved, print_command, table, timed

warnings.filterwarnings("ignore")
SHARDS, PER_SHARD = 12, 2000
READS = {"n": 0}
WORKER_READS = multiprocessing.Value("q", 0)  # items read by DataLoader workers (forked: they share it)


def generate(shards: List[int]):
    """A generator dataset: items numbered across shards; counts every item it yields (in-process)."""
    for s in shards:
        for i in range(PER_SHARD):
            READS["n"] += 1
            yield {"x": s * PER_SHARD + i}


def hf_stream(shards: int = SHARDS):
    import datasets

    return datasets.IterableDataset.from_generator(generate,
                                                   gen_kwargs={"shards": list(range(shards))}).with_format("numpy")


def reads_per_process() -> str:
    import torch
    from accelerate.data_loader import prepare_data_loader
    from datasets.distributed import split_dataset_by_node

    import unified
    from backends.common import _reader_stream
    from unified.data import PreparedIterableLoader, default_collate
    from unified.data.streams import HuggingFaceStream

    class Plain:
        """A stream with no shards nor state (any iterable): every process reads it whole."""

        def __iter__(self):
            return generate(list(range(SHARDS)))

    class ByWorker(torch.utils.data.IterableDataset):
        """A torch IterableDataset that splits its shards by get_worker_info() (torch's idiom);
        counts its reads in a counter its worker processes share."""

        def __init__(self, split: bool = True) -> None:
            self.split = split

        def __iter__(self):
            info = torch.utils.data.get_worker_info() if self.split else None
            mine = [s for s in range(SHARDS) if info is None or s % info.num_workers == info.id]
            for item in generate(mine):
                with WORKER_READS.get_lock():
                    WORKER_READS.value += 1
                yield item

    def worker_reads(iterable) -> int:
        WORKER_READS.value = 0
        for _ in iterable:
            pass
        return WORKER_READS.value

    rows = []
    for world in (2, 3):
        counts: Dict[str, List[int]] = {"ours": [], "accelerate": [], "library": [],
                                        "ours, torch IterableDataset split by worker, 2 workers": [],
                                        "accelerate, the same": [],
                                        "ours, torch IterableDataset that does not split, 2 workers": [],
                                        "ours, a stream without shards, no workers": []}
        for rank in range(world):
            READS["n"] = 0
            placement = types.SimpleNamespace(process_index=rank, num_processes=world, uneven_batches=True,
                                              place_batch=lambda batch: batch)
            for _ in PreparedIterableLoader(unified.DataLoader(Plain(), batch_size=32), placement, 0):
                pass
            counts["ours, a stream without shards, no workers"].append(READS["n"])
            for split, name in ((True, "ours, torch IterableDataset split by worker, 2 workers"),
                                (False, "ours, torch IterableDataset that does not split, 2 workers")):
                loader = torch.utils.data.DataLoader(ByWorker(split), batch_size=32, num_workers=2)
                counts[name].append(worker_reads(_reader_stream(loader, placement, 0).open(0, None)))
            peer = prepare_data_loader(torch.utils.data.DataLoader(ByWorker(), batch_size=32, num_workers=2), None,
                                       num_processes=world, process_index=rank, put_on_device=False)
            counts["accelerate, the same"].append(worker_reads(peer))
            READS["n"] = 0
            for _ in HuggingFaceStream(hf_stream(), rank, world, 32, default_collate).open(0, None):
                pass
            counts["ours"].append(READS["n"])
            READS["n"] = 0
            loader = prepare_data_loader(torch.utils.data.DataLoader(hf_stream(), batch_size=32), None,
                                         num_processes=world, process_index=rank, put_on_device=False)
            for _ in loader:
                pass
            counts["accelerate"].append(READS["n"])
            READS["n"] = 0
            for _ in split_dataset_by_node(hf_stream(), rank=rank, world_size=world):
                pass
            counts["library"].append(READS["n"])
        total = SHARDS * PER_SHARD
        for name, values in counts.items():
            rows.append([f"P={world}", name, " / ".join(map(str, values)), f"{max(values) / total:.3f}"])
    return table(["processes", "loader", "items read by each process", "largest share of the stream"], "llrr", rows)


def _first_batch(start: Callable[[], Any]) -> Callable[[], None]:
    """From a fresh loader (``start()``) to its first batch."""
    def run() -> None:
        next(iter(start()))
    return run


def resume_times(position: int, rounds: int, folder: str) -> str:
    import grain
    import torch
    from accelerate import Accelerator as AccelerateAccelerator
    from accelerate import skip_first_batches
    from torchdata.stateful_dataloader import StatefulDataLoader

    import unified

    size = position * 2
    data = np.arange(size, dtype=np.int64)

    def torchdata_loader():
        torch.manual_seed(0)
        return StatefulDataLoader(data, batch_size=1, shuffle=True)

    def stream_loader():
        return StatefulDataLoader(hf_stream_long(size), batch_size=1)

    def grain_loader():
        sampler = grain.samplers.IndexSampler(num_records=size, shuffle=True, num_epochs=1, seed=0)
        return grain.DataLoader(data_source=data, sampler=sampler, operations=[grain.transforms.Batch(batch_size=1)])

    rows = []

    def measure(name, make):
        """One loader's rows: resumed by ours, by its own state, by its peer."""
        target = os.path.join(folder, name.replace(" ", "_"))
        acc = unified.Accelerator(backend="torch", seed=0)
        prepared = acc.prepare(make())
        for _ in itertools.islice(iter(prepared), position):
            pass
        acc.save_state(target)

        def ours():
            fresh = unified.Accelerator(backend="torch", seed=0)
            loader = fresh.prepare(make())
            fresh.load_state(target)
            return loader

        library = make()
        if hasattr(library, "state_dict"):
            it = iter(library)
            for _ in itertools.islice(it, position):
                pass
            state = library.state_dict()

            def own():
                loader = make()
                loader.load_state_dict(state)
                return loader
        else:
            it = iter(library)
            for _ in itertools.islice(it, position):
                pass
            grain_state = it.get_state()

            def own():
                fresh = iter(make())
                fresh.set_state(grain_state)
                return fresh

        if name == "Grain DataLoader":
            def peer():
                return itertools.islice(iter(make()), position, None)
            peer_name = "read and drop"
        else:
            def peer():
                accelerate = AccelerateAccelerator(cpu=True)
                return skip_first_batches(accelerate.prepare(make()), position)
            peer_name = "Accelerate skip_first_batches"
        measured = {**interleaved({"ours": _first_batch(ours), "library state": _first_batch(own)}, rounds, warmup=0),
                    **interleaved({peer_name: _first_batch(peer)}, max(1, rounds // 2), warmup=0)}
        reference = statistics.median(measured["library state"])
        for who, values in measured.items():
            rows.append([name, who, *cells(values, "min median max ratio", reference, scale=1e3, digits=1)])

    for name, make in (("torchdata StatefulDataLoader", torchdata_loader), ("datasets stream", stream_loader),
                       ("Grain DataLoader", grain_loader)):
        measure(name, make)
    return table(["loader", "resume by", "min (ms)", "median", "max", "median / library state"], "llrrrr", rows)


def hf_stream_long(size: int):
    import datasets

    per = size // 8

    def long_shards(shards):
        for s in shards:
            for i in range(per):
                yield {"x": s * per + i}

    return datasets.IterableDataset.from_generator(long_shards,
                                                   gen_kwargs={"shards": list(range(8))}).with_format("numpy")


def per_batch_cost(batches: int, rounds: int) -> str:
    import grain
    from torchdata.stateful_dataloader import StatefulDataLoader

    import unified

    rows_per, width = 32, 256
    data = np.random.default_rng(0).standard_normal((batches * rows_per, width)).astype(np.float32)

    def vectors(shards):
        for s in shards:
            for row in data[s::8]:
                yield {"x": row}

    def stream():
        import datasets

        return datasets.IterableDataset.from_generator(vectors,
                                                       gen_kwargs={"shards": list(range(8))}).with_format("numpy")

    def grain_loader():
        sampler = grain.samplers.IndexSampler(num_records=len(data), shuffle=True, num_epochs=1, seed=0)
        return grain.DataLoader(data_source=data, sampler=sampler,
                                operations=[grain.transforms.Batch(batch_size=rows_per)])

    cases = {
        "torchdata StatefulDataLoader, 2 workers":
            lambda: StatefulDataLoader(data, batch_size=rows_per, shuffle=True, num_workers=2),
        "datasets stream, StatefulDataLoader 2 workers":
            lambda: StatefulDataLoader(stream(), batch_size=rows_per, num_workers=2),
        "Grain DataLoader": grain_loader,
    }
    def epoch(make: Callable[[], Any], prepared: bool) -> Callable[[], float]:
        """Seconds per batch of one epoch of a fresh loader (made and prepared untimed)."""
        def run() -> float:
            loader = make()
            if prepared:
                loader = unified.Accelerator(backend="torch", seed=0).prepare(loader)
            count = []
            return timed(lambda: count.append(sum(1 for _ in loader))) / count[0]
        return run

    out = []
    for name, make in cases.items():
        times = interleaved({"alone": epoch(make, False), "prepared": epoch(make, True)}, rounds, warmup=0)
        reference = statistics.median(times["alone"])
        for who, values in times.items():
            out.append([name, who, *cells(values, "min median max ratio", reference, scale=1e6, digits=1)])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (table(["loader", "", "min (us/batch)", "median", "max", "median / alone"], "llrrrr", out)
            + f"\n\npeak RSS of the benchmark process: {peak:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--position", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=1500)
    parser.add_argument("--parts", default="reads,resume,cost", help="which tables, comma-separated")
    args = parser.parse_args()
    print_command()
    parts = set(args.parts.split(","))
    if "reads" in parts:
        print("## Items read per process\n")
        print(reads_per_process())
    if "resume" in parts:
        with tempfile.TemporaryDirectory() as folder:
            print(f"\n## Resume at position {args.position:,}\n")
            print(resume_times(args.position, args.rounds, folder))
    if "cost" in parts:
        print(f"\n## Per-batch cost, {args.batches} batches\n")
        print(per_batch_cost(args.batches, args.rounds))


if __name__ == "__main__":
    main()
