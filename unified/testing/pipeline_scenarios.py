"""Scenarios of the data pipelines people use (issue 28): torchdata's ``StatefulDataLoader``
with workers, a Hugging Face ``datasets`` stream read 1/P per process with workers, and a Grain
``DataLoader``, each prepared whole, iterated for an epoch (``gather_for_metrics`` sees every
sample once), saved mid-epoch and resumed by a fresh Accelerator. A library that is not installed
makes its scenario return ``{"missing": ...}`` (the test skips with the extra to install).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Dict

import numpy as np

from unified import Accelerator
from unified.testing.scenario import scenario

from .data_scenarios import CountingDataset
from .scenarios import _shared

EXTRAS = {"datasets": "data", "grain": "data", "torchdata": "torchdata"}  # module -> the extra that installs it
HF_SHARDS = 6  # divides by 2 and 3: every process reads whole shards of its own
HF_SHARD_LENGTH = 3  # shard s holds 3 + s examples: the processes' shares end at different steps


def _missing(*modules: str) -> Dict[str, str]:
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    extras = ",".join(sorted({EXTRAS[m] for m in absent}))
    return {"missing": f"needs {', '.join(absent)}: pip install 'unified[{extras}]'"} if absent else {}


def _local_ids(batch: Any) -> list:
    """This process's sample ids of a batch: a dict's "x", a torch tensor or a global jax.Array."""
    x = batch["x"] if isinstance(batch, dict) else batch
    if hasattr(x, "addressable_shards"):
        x = np.concatenate([np.asarray(s.data) for s in x.addressable_shards])
    return np.asarray(x).ravel().tolist()


def _exercise(make: Callable[[Accelerator], Any], target: str, rows=_local_ids) -> Dict[str, Any]:
    """An epoch that saves after 2 batches and goes on to its end, every batch gathered for
    metrics (its batches, ``first`` + ``rest``, are the ``epoch``: a save must not disturb the
    live loader); then a fresh Accelerator that loads and continues (skip_first_batches to the
    same step). Two loaders, not three: a library's loader may start worker processes (Grain
    spawns them), the costly part of a group."""
    saving = Accelerator(timeout=60)
    live = make(saving)
    stream = iter(live)
    first, rest, metrics = [], [], []
    for k, batch in enumerate(stream):
        (first if k < 2 else rest).append(rows(batch))
        x = batch["x"] if isinstance(batch, dict) else batch
        metrics += np.asarray(saving.gather_for_metrics(x)).ravel().tolist()
        if k == 1:
            saving.save_state(target)
    fresh = Accelerator(timeout=60)
    again = make(fresh)
    fresh.load_state(target)
    resumed = [rows(b) for b in fresh.skip_first_batches(again, 2)]
    return {"epoch": first + rest, "metrics": metrics, "first": first, "rest": rest, "resumed": resumed}


@scenario(requires=("ForeignLoaders",))
def pipeline_torchdata(state: dict) -> dict:
    """torchdata's StatefulDataLoader(shuffle=True, num_workers=2) over map-style data, built
    after torch's global generator was seeded differently on every process (as an unseeded
    script's is): the shares are still disjoint and a resume draws the same order."""
    missing = _missing("torchdata")
    if missing:
        return missing
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    calls = {"n": 0}

    def make(acc: Accelerator) -> Any:
        calls["n"] += 1
        torch.manual_seed(1000 * calls["n"] + acc.process_index)  # another sampler seed on every process and run
        return acc.prepare(StatefulDataLoader(CountingDataset(24), batch_size=2, shuffle=True, num_workers=2))

    return _exercise(make, _shared(f"torchdata_{state['acc'].num_processes}"))


def hf_examples(shards: list, log: str):
    """A Hugging Face generator: shard ``s`` holds ``3 + s`` examples with ids numbered across
    shards; every shard opened is a line in ``log`` (who reads what)."""
    for s in shards:
        with open(log, "a") as f:
            f.write(f"{s}\n")
        start = sum(HF_SHARD_LENGTH + k for k in range(s))
        for i in range(HF_SHARD_LENGTH + s):
            yield {"x": start + i}


def hf_total() -> int:
    return sum(HF_SHARD_LENGTH + k for k in range(HF_SHARDS))


@scenario(requires=("ForeignLoaders",))
def pipeline_hf_stream(state: dict) -> dict:
    """A datasets.IterableDataset of 6 shards of unequal length in a torch DataLoader with 2
    workers: each process reads its own shards only; the shares end at different steps."""
    missing = _missing("datasets", "torchdata")
    if missing:
        return missing
    import datasets
    import torch

    size = state["acc"].num_processes
    logs = []

    def make(acc: Accelerator) -> Any:
        log = _shared(f"hf_reads_{size}_{len(logs)}_{acc.process_index}.log")
        logs.append(log)
        stream = datasets.IterableDataset.from_generator(
            hf_examples, gen_kwargs={"shards": list(range(HF_SHARDS)), "log": log}).with_format("numpy")
        return acc.prepare(torch.utils.data.DataLoader(stream, batch_size=2, num_workers=2))

    result = _exercise(make, _shared(f"hf_{size}"))

    def opened(log: str) -> list:
        return sorted(int(line) for line in open(log).read().split()) if os.path.exists(log) else []

    result["shards_read"] = opened(logs[0])  # the first epoch: the shards this process opened
    return result


@scenario
def pipeline_grain(state: dict) -> dict:
    """A Grain DataLoader handed whole (no shard options; shuffled; 2 workers): prepare gives
    each process its own records; the position holds every worker's."""
    missing = _missing("grain")
    if missing:
        return missing
    import grain
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # Grain's workers read absl flags; a script runs under absl.app.run or does this

    def make(acc: Accelerator) -> Any:
        sampler = grain.samplers.IndexSampler(num_records=30, shuffle=True, num_epochs=1, seed=3)
        return acc.prepare(grain.DataLoader(data_source=np.arange(30), sampler=sampler,
                                            operations=[grain.transforms.Batch(batch_size=2)], worker_count=2))

    return _exercise(make, _shared(f"grain_{state['acc'].num_processes}"))


TORCH_STREAM = 24  # items of the torch IterableDatasets below


def _torch_streams(log: str) -> Dict[str, Any]:
    """Two torch IterableDatasets of TORCH_STREAM ids that log every item they read to ``log``:
    one splits its reading by ``get_worker_info()`` (torch's idiom) and keeps its position
    (torchdata's protocol), the other reads the whole stream wherever it runs."""
    import torch

    def note(i: int) -> None:
        with open(log, "a") as f:
            f.write(f"{i}\n")

    class SplitByWorker(torch.utils.data.IterableDataset):
        def __init__(self) -> None:
            self.next = None  # this worker's next id

        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            first, step = (info.id, info.num_workers) if info is not None else (0, 1)
            i = first if self.next is None else self.next
            while i < TORCH_STREAM:
                self.next = i + step
                note(i)
                yield {"x": np.array([i], dtype=np.int64)}
                i = self.next
            self.next = None

        def state_dict(self) -> dict:
            return {"next": self.next}

        def load_state_dict(self, state: dict) -> None:
            self.next = state["next"]

    class Whole(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(TORCH_STREAM):
                note(i)
                yield {"x": np.array([i], dtype=np.int64)}

    return {"split": SplitByWorker(), "whole": Whole()}


@scenario(requires=("ForeignLoaders",))
def pipeline_torch_stream(state: dict) -> dict:
    """A torch IterableDataset in a torch DataLoader with 2 workers: every worker of every
    process is one reader; the one that splits by worker info reads only its part, the other is
    read whole by every reader, which keeps its own blocks."""
    missing = _missing("torchdata")
    if missing:
        return missing
    import torch

    size = state["acc"].num_processes

    def exercise(kind: str) -> Dict[str, Any]:
        logs = []

        def make(acc: Accelerator) -> Any:
            log = _shared(f"torch_{kind}_{size}_{len(logs)}_{acc.process_index}.log")
            logs.append(log)
            dataset = _torch_streams(log)[kind]
            return acc.prepare(torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2))

        result = _exercise(make, _shared(f"torch_{kind}_{size}"))
        result["reads"] = len(open(logs[0]).read().split()) if os.path.exists(logs[0]) else 0  # the first epoch
        return result

    out: Dict[str, Any] = {}
    for kind in ("split", "whole"):
        out[kind] = exercise(kind)
    return out
