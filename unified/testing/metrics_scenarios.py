"""Scenarios of `test_metrics.py`: evaluation over processes (`gather_for_metrics`,
`pad_across_processes`) and torch DataLoaders with their own samplers, written once for every
backend. Same rules as `scenarios.py`; run with
``UNIFIED_TEST_SCENARIOS=unified.testing.metrics_scenarios,unified.testing.scenarios``.
"""
from __future__ import annotations

import random

import numpy as np

import unified
from unified import Accelerator
from unified.testing.scenario import scenario

from .data_scenarios import CountingDataset, Stream, _rows

# (samples, batch size per process): uneven over processes and batches, a last batch smaller than
from .scenarios import _shared

# the batch size, an evaluation set smaller than one global batch, and one that divides evenly.
EVAL_SIZES = [(10, 3), (7, 2), (5, 4), (12, 2)]


def _flat(value) -> list:
    return np.asarray(value).ravel().tolist()


def _local(value) -> np.ndarray:
    """This process's rows of a batch leaf as NumPy (a global jax.Array: the rows it holds)."""
    if hasattr(value, "addressable_shards"):
        return np.concatenate([np.asarray(s.data) for s in value.addressable_shards])
    return np.asarray(value)


def _evaluate(acc, loader) -> dict:
    """gather_for_metrics of the batches as they come (a global jax.Array on JAX), of every
    process's own NumPy rows, and of a nested tree; the ids in gathered order."""
    ids, local_ids, nested_ok, counts = [], [], True, []
    for batch in loader:
        x = batch["x"]
        got = _flat(acc.gather_for_metrics(x))
        ids += got
        counts.append(len(got))
        local_ids += _flat(acc.gather_for_metrics(_local(x)))
        tree = acc.gather_for_metrics({"ids": x, "pair": (x * 2, [x + 1])})
        nested_ok &= (_flat(tree["ids"]) == got and _flat(tree["pair"][0]) == [2 * i for i in got]
                      and _flat(tree["pair"][1][0]) == [i + 1 for i in got] and isinstance(tree["pair"], tuple))
    return {"ids": ids, "local_ids": local_ids, "nested_ok": bool(nested_ok), "counts": counts}


@scenario
def metrics_unified_loader(state: dict) -> dict:
    acc = state["acc"]
    out = {}
    for n, b in EVAL_SIZES:
        loader = acc.prepare(unified.DataLoader(CountingDataset(n), batch_size=b, shuffle=True, seed=3))
        out[f"{n}/{b}"] = {**_evaluate(acc, loader), "order": loader.epoch_order(0).tolist() if n else []}
    return out


@scenario(requires=("ForeignLoaders",))
def metrics_torch_loader(state: dict) -> dict:
    acc = state["acc"]
    import torch

    out = {}
    for n, b in EVAL_SIZES:
        loader = acc.prepare(torch.utils.data.DataLoader(CountingDataset(n), batch_size=b, shuffle=False))
        out[f"{n}/{b}"] = _evaluate(acc, loader)
    return out


@scenario
def metrics_iterable(state: dict) -> dict:
    acc = state["acc"]
    out = {}
    for n, b in EVAL_SIZES:
        out[f"{n}/{b}"] = _evaluate(acc, acc.prepare(unified.DataLoader(Stream(n), batch_size=b)))
    return out


@scenario
def metrics_objects_and_nesting(state: dict) -> dict:
    """Strings through use_gather_object; an evaluation inside a training loop; a value whose rows
    are not the batch's is refused on the batch with repeats (on every process alike)."""
    acc = state["acc"]
    train = acc.prepare(unified.DataLoader(CountingDataset(10), batch_size=3))
    evaluation = acc.prepare(unified.DataLoader(CountingDataset(10), batch_size=3))
    names, inner, outer, refused, as_rows = [], [], [], [], []
    for step, batch in enumerate(train):
        if step == 0:
            for eval_batch in evaluation:
                rows = _local(eval_batch["x"]).ravel().tolist()
                names += acc.gather_for_metrics([f"sample-{i}" for i in rows], use_gather_object=True)
                inner += _flat(acc.gather_for_metrics(eval_batch["x"]))
                as_rows += [_flat(row) for row in acc.gather_for_metrics(eval_batch["x"], use_gather_object=True)]
                try:
                    acc.gather_for_metrics(np.float32(1.0) * np.ones(()))  # one value per process
                except ValueError as err:
                    refused.append("gather-for-metrics-rows" in str(err))
        outer += _flat(acc.gather_for_metrics(batch["x"]))  # the training loader's batch again
    after = _flat(acc.gather(np.array([acc.process_index])))
    return {"names": names, "inner": inner, "outer": outer, "refused": refused, "after": after, "as_rows": as_rows}


@scenario
def metrics_pad(state: dict) -> dict:
    acc = state["acc"]
    r = acc.process_index
    vec = np.arange(r + 1, dtype=np.int64) + 1                      # 1 .. r+1
    grid = np.full((2, r + 2), r + 1, dtype=np.float32)             # columns differ
    padded = acc.pad_across_processes(vec)
    first = acc.pad_across_processes(vec, pad_index=-1, pad_first=True)
    tree = acc.pad_across_processes({"grid": grid, "pair": (vec, np.ones(3, dtype=np.int64))}, dim=1, pad_index=7)
    negative = acc.pad_across_processes(grid, dim=-1)
    return {
        "padded": _flat(acc.gather(padded)), "shape": list(np.shape(padded)),
        "first": _flat(acc.gather(first)),
        "grid": np.asarray(acc.gather(tree["grid"])).tolist(),
        "untouched": [list(np.shape(tree["pair"][0])), list(np.shape(tree["pair"][1]))],  # no axis 1: as is
        "negative_shape": list(np.shape(negative)),
        "dtype": str(np.asarray(_local(padded)).dtype),
    }


# -- custom samplers ------------------------------------------------------------------------------
class BucketBatchSampler:
    """Length buckets, as in NLP and speech: samples grouped by their length, each bucket cut into
    batches, the batches shuffled with Python's global ``random`` (seeded by unified per epoch)."""

    def __init__(self, lengths, batch_size: int, equal_sizes: bool) -> None:
        self.buckets = {}
        for i, length in enumerate(lengths):
            self.buckets.setdefault(length, []).append(i)
        self.batch_size, self.equal_sizes, self.epoch = batch_size, equal_sizes, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self):
        out = []
        for _, members in sorted(self.buckets.items()):
            members = list(members)
            random.shuffle(members)
            cut = [members[i:i + self.batch_size] for i in range(0, len(members), self.batch_size)]
            out += [c for c in cut if len(c) == self.batch_size] if self.equal_sizes else cut
        random.shuffle(out)
        return out

    def __len__(self) -> int:  # without drawing: len() must not move the global generator
        full = sum(len(m) // self.batch_size for m in self.buckets.values())
        return full if self.equal_sizes else full + sum(bool(len(m) % self.batch_size) for m in self.buckets.values())

    def __iter__(self):
        return iter(self._batches())


class StatefulSampler:
    """An index sampler with its own generator that moves on every epoch, and state_dict()."""

    def __init__(self, n: int) -> None:
        self.n, self.rng = n, np.random.default_rng(11)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]


def _lengths(n: int) -> list:
    return [1 + (i * 7) % 3 for i in range(n)]  # three lengths: buckets of about n/3


def _sampler_loaders(acc):
    import torch

    equal = getattr(acc._backend, "uneven_batches", True) is False
    n = 28 if equal else 25  # JAX: 13 batches of 2; torch: 13 batches, one of them of 1 sample
    dataset = CountingDataset(n)
    buckets = acc.prepare(torch.utils.data.DataLoader(dataset, batch_sampler=BucketBatchSampler(_lengths(n), 2, equal)))
    subset = torch.utils.data.SubsetRandomSampler(list(range(0, 20, 2)) + [21, 23, 25],
                                                  generator=torch.Generator().manual_seed(4))
    picked = acc.prepare(torch.utils.data.DataLoader(CountingDataset(26), batch_size=2, sampler=subset))
    stateful = acc.prepare(torch.utils.data.DataLoader(CountingDataset(15), batch_size=2, sampler=StatefulSampler(15)))
    return {"buckets": buckets, "subset": picked, "stateful": stateful}, n


@scenario(requires=("ForeignLoaders",))
def sampler_epochs(state: dict) -> dict:
    """Two epochs of each sampler loader: every process's rows, the gathered evaluation, padding."""
    acc = state["acc"]
    loaders, n = _sampler_loaders(acc)
    out = {"n": n, "type": {k: type(v).__name__ for k, v in loaders.items()}}
    for name, loader in loaders.items():
        epochs, gathered = [], []
        for _ in range(2):
            rows, seen = [], []
            for batch in loader:
                rows.append(_rows(batch))
                seen += _flat(acc.gather_for_metrics(batch["x"]))
            epochs.append(rows)
            gathered.append(seen)
        skipped = [_rows(b) for b in acc.skip_first_batches(loader, 1)]  # epoch 2 from its 2nd step
        out[name] = {"epochs": epochs, "gathered": gathered, "len": len(loader), "skipped": skipped}
    return out


@scenario(requires=("ForeignLoaders",))
def sampler_resume(state: dict) -> dict:
    """Save in the middle of epoch 1; a fresh Accelerator and fresh loaders continue exactly."""
    acc = Accelerator(timeout=60, seed=2)
    target = _shared(f"sampler_ckpt_{acc.num_processes}")
    loaders, _ = _sampler_loaders(acc)
    for loader in loaders.values():
        for _ in loader:  # epoch 0
            pass
    for loader in loaders.values():
        for i, _ in enumerate(loader):
            if i == 1:
                break
    acc.save_state(target)
    expected = {name: [_rows(b) for b in loader] + [_rows(b) for b in loader] for name, loader in loaders.items()}
    fresh = Accelerator(timeout=60, seed=2)
    again, _ = _sampler_loaders(fresh)
    fresh.load_state(target)
    resumed = {name: [_rows(b) for b in loader] + [_rows(b) for b in loader] for name, loader in again.items()}
    with_skip = {}
    fresh2 = Accelerator(timeout=60, seed=2)
    third, _ = _sampler_loaders(fresh2)
    fresh2.load_state(target)
    for name, loader in third.items():  # Accelerate's idiom on top: lands on the same step
        with_skip[name] = [_rows(b) for b in fresh2.skip_first_batches(loader, 2)] + [_rows(b) for b in loader]
    return {"expected": expected, "resumed": resumed, "with_skip": with_skip}
