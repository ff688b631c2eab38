"""Data scenarios of the conformance suite (epochs, skipping, resuming, other process counts,
iterable and torch-worker loaders) and the experiment trackers, written once for every backend.
Same rules as `scenarios.py`."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

import unified
from unified import Accelerator
from unified.testing.scenario import scenario

from .scenarios import _shared


# -- data ------------------------------------------------------------------------------------------
class CountingDataset:
    """Map-style data whose samples are their own index; counts __getitem__ calls."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.calls += 1
        return {"x": np.array([i], dtype=np.int64)}


def _rows(batch) -> list:
    """This process's sample ids of a batch (torch tensor or global jax.Array)."""
    x = batch["x"]
    if hasattr(x, "addressable_shards"):
        x = np.concatenate([np.asarray(s.data) for s in x.addressable_shards])
    return np.asarray(x).ravel().tolist()


def _loader(acc, n=10, batch_size=2, seed=5, prefetch=0):
    dataset = CountingDataset(n)
    return dataset, acc.prepare(unified.DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=seed,
                                                   prefetch=prefetch))


@scenario
def data_epochs(state: dict) -> dict:
    acc = state["acc"]
    _, loader = _loader(acc)
    epochs = [[_rows(b) for b in loader] for _ in range(2)]
    batch = next(iter(loader))  # epoch 2's first batch: a global jax.Array on JAX
    gathered = np.asarray(acc.gather(batch["x"])).ravel().tolist()
    loss_like = acc.reduce(batch["x"].sum() * 0 + 1, "sum")  # a jitted step's replicated scalar
    return {"epochs": epochs, "padding": [loader.padding_in_batch(k) for k in range(len(loader))],
            "gathered": gathered, "first_rows": _rows(batch), "reduced": float(np.asarray(loss_like))}


@scenario
def data_skip(state: dict) -> dict:
    acc = state["acc"]
    dataset, loader = _loader(acc)
    _, reference = _loader(acc)
    ref = [[_rows(b) for b in reference] for _ in range(3)]
    first = [_rows(b) for b in loader]
    dataset.calls = 0
    skipped = [_rows(b) for b in acc.skip_first_batches(loader, 2)]
    calls = dataset.calls
    after = [_rows(b) for b in loader]
    return {"ref": ref, "first": first, "skipped": skipped, "calls": calls, "after": after,
            "batch_size": loader.batch_size}


@scenario
def data_resume(state: dict) -> dict:
    """Save mid-epoch; a fresh Accelerator loads and continues (with and without a manual skip)."""
    acc = Accelerator(timeout=60)
    target = _shared(f"data_ckpt_{acc.num_processes}")
    _, loader = _loader(acc, n=24, batch_size=2)
    seen = []
    for i, batch in enumerate(loader):
        seen.append(_rows(batch))
        if i == 2:
            acc.save_state(target)
            break
    expected = [_rows(b) for b in loader] + [_rows(b) for b in loader]  # rest of epoch 0, then epoch 1
    outcomes = {}
    for manual_skip in (False, True):
        fresh = Accelerator(timeout=60)
        _, again = _loader(fresh, n=24, batch_size=2)
        fresh.load_state(target)
        first = fresh.skip_first_batches(again, 3) if manual_skip else again
        outcomes[str(manual_skip)] = [_rows(b) for b in first] + [_rows(b) for b in again]
    # the same with batches placed ahead in a background thread: a prefetched batch is not consumed
    ahead = Accelerator(timeout=60)
    _, loader = _loader(ahead, n=24, batch_size=2, prefetch=3)
    seen_ahead = []
    for i, batch in enumerate(loader):
        seen_ahead.append(_rows(batch))
        if i == 2:
            time.sleep(0.2)  # the producer runs ahead meanwhile
            ahead.save_state(target + "_prefetch")
            break
    fresh = Accelerator(timeout=60)
    _, again = _loader(fresh, n=24, batch_size=2, prefetch=3)
    fresh.load_state(target + "_prefetch")
    return {"expected": expected, "resumed": outcomes["False"], "resumed_with_skip": outcomes["True"], "seen": seen,
            "seen_prefetch": seen_ahead, "resumed_prefetch": [_rows(b) for b in again] + [_rows(b) for b in again]}


@scenario
def data_save_for_other_count(state: dict) -> dict:
    acc = state["acc"]
    _, loader = _loader(acc, n=24, batch_size=1)
    global_order = loader.epoch_order(0).tolist()
    for i, _ in enumerate(loader):
        if i == 5:  # 6 global batches of 2 = 12 samples consumed
            acc.save_state(_shared("data_ckpt_count"))
            break
    return {"order": global_order}


@scenario
def data_load_other_count(state: dict) -> dict:
    acc = state["acc"]
    _, loader = _loader(acc, n=24, batch_size=1)
    import warnings
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        acc.load_state(_shared("data_ckpt_count"))
    return {"rest": [_rows(b) for b in loader], "position": loader.position}


@scenario(requires=("ForeignLoaders",))
def data_torch_workers(state: dict) -> dict:
    import torch

    acc = state["acc"]

    dataset = CountingDataset(10)
    loader = acc.prepare(torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=True, num_workers=2))
    _, reference = _loader(acc, seed=acc.seed or 0)
    epochs = [[_rows(b) for b in loader] for _ in range(2)]
    ref = [[_rows(b) for b in reference] for _ in range(2)]
    skipped = [_rows(b) for b in acc.skip_first_batches(loader, 1)]
    return {"epochs": epochs, "ref": ref, "skipped_rows": skipped, "ref_epoch2": [_rows(b) for b in reference]}


class Stream:
    """Iterable data (no __len__/__getitem__) of sample ids; counts the items it yields."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.reads += 1
            yield {"x": np.array([i], dtype=np.int64)}


class StatefulStream(Stream):
    """torchdata's protocol: the position lives in the dataset and resumes without re-reading."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.next = 0

    def __iter__(self):
        while self.next < self.n:
            i, self.next = self.next, self.next + 1
            self.reads += 1
            yield {"x": np.array([i], dtype=np.int64)}
        self.next = 0

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]


@scenario
def data_iterable(state: dict) -> dict:
    acc = Accelerator(timeout=60)
    plain = Stream(20)
    loader = acc.prepare(unified.DataLoader(plain, batch_size=2))
    epoch0 = [_rows(b) for b in loader]
    skipped = [_rows(b) for b in acc.skip_first_batches(loader, 2)]
    read_to_skip = loader.items_read_to_skip
    dropping = Accelerator(timeout=60).prepare(unified.DataLoader(Stream(20), batch_size=2, drop_last=True))
    epoch0_drop_last = [_rows(b) for b in dropping]
    target = _shared(f"iter_ckpt_{acc.num_processes}")
    stream = StatefulStream(20)
    live = acc.prepare(unified.DataLoader(stream, batch_size=2))
    first = []
    for i, batch in enumerate(live):
        first.append(_rows(batch))
        if i == 1:
            acc.save_state(target)
            break
    rest = [_rows(b) for b in live]
    fresh = Accelerator(timeout=60)
    _ = fresh.prepare(unified.DataLoader(Stream(20), batch_size=2))
    again_stream = StatefulStream(20)
    again = fresh.prepare(unified.DataLoader(again_stream, batch_size=2))
    fresh.load_state(target)
    resumed = [_rows(b) for b in fresh.skip_first_batches(again, 2)]
    return {"epoch0": epoch0, "epoch0_drop_last": epoch0_drop_last, "skipped": skipped, "read_to_skip": read_to_skip,
            "first": first, "rest": rest,
            "resumed": resumed, "resumed_reads": again_stream.reads}



@scenario
def data_dispatch(state: dict) -> dict:
    """``DataLoaderConfiguration(dispatch_batches=True)``: process 0 reads, each step it sends every
    process its rows of ``P`` of the loader's batches (Accelerate's dispatcher); a mid-epoch
    checkpoint resumes with exactly the remaining batches. On a backend whose step batches are one
    global array (``uneven_batches=False``) prepare refuses it, naming that backend's way."""
    config = unified.DataLoaderConfiguration(dispatch_batches=True)
    acc = Accelerator(timeout=60, dataloader_config=config)
    global_arrays = getattr(acc._backend, "uneven_batches", True) is False
    dataset = CountingDataset(13)
    try:
        loader = acc.prepare(unified.DataLoader(dataset, batch_size=2))
    except NotImplementedError as err:
        return {"global_arrays": global_arrays, "refused": str(err)}
    epoch, gathered = [], []
    for batch in loader:
        epoch.append(_rows(batch))
        gathered += np.asarray(acc.gather_for_metrics(batch["x"])).ravel().tolist()
    stream = StatefulStream(13)
    streamed = acc.prepare(unified.DataLoader(stream, batch_size=2))
    target = _shared(f"dispatch_ckpt_{acc.num_processes}")
    seen = []
    for batch in streamed:
        seen.append(_rows(batch))
        if len(seen) == 2:
            acc.save_state(target)
            break
    rest = [_rows(b) for b in streamed] + [_rows(b) for b in streamed]  # the epoch's rest, then the next
    for i, _ in enumerate(loader):  # the map-style loader, saved mid-epoch too
        if i == 1:
            acc.save_state(target + "_map")
            break
    map_rest = [_rows(b) for b in loader]
    fresh = Accelerator(timeout=60, dataloader_config=config)  # the same loaders, in the same order
    fresh.prepare(unified.DataLoader(CountingDataset(13), batch_size=2))
    again_stream = StatefulStream(13)
    again = fresh.prepare(unified.DataLoader(again_stream, batch_size=2))
    fresh.load_state(target)
    resumed = [_rows(b) for b in again] + [_rows(b) for b in again]
    other = Accelerator(timeout=60, dataloader_config=config)
    map_again = other.prepare(unified.DataLoader(CountingDataset(13), batch_size=2))
    other.prepare(unified.DataLoader(StatefulStream(13), batch_size=2))
    other.load_state(target + "_map")
    return {"global_arrays": global_arrays, "epoch": epoch, "gathered": gathered, "reads": dataset.calls,
            "streamed": seen, "rest": rest, "resumed": resumed, "resumed_reads": again_stream.reads,
            "map_rest": map_rest, "map_resumed": [_rows(b) for b in map_again], "length": len(loader)}


def _refusal(err: Exception, acc: Accelerator) -> dict:
    return {"global_arrays": getattr(acc._backend, "uneven_batches", True) is False, "refused": str(err),
            "error": type(err).__name__}


def _torch_loader(acc: Accelerator, batch_size: int) -> Any:
    """A torch ``DataLoader`` of 13 counted samples prepared by ``acc``, or None where the backend
    prepares no foreign loaders (`ForeignLoaders`: a third backend may have none)."""
    from unified.backend import ForeignLoaders

    if not isinstance(acc._backend, ForeignLoaders):
        return None
    import torch

    return acc.prepare(torch.utils.data.DataLoader(CountingDataset(13), batch_size=batch_size))


@scenario
def data_uneven(state: dict) -> dict:
    """``DataLoaderConfiguration(even_batches=False)`` without dispatch: every process reads its
    own batches of 13 samples in batches of 2, the epoch's last global batch left as it is (a
    process gets a short last batch or one batch fewer, no repeats), for unified's loader and a
    torch ``DataLoader``; a checkpoint in the middle of the epoch (where a process of 3 has had
    all its batches) resumes with exactly the rest, with or without ``skip_first_batches``.
    A backend whose step batches are one global array refuses it in `prepare`."""
    config = unified.DataLoaderConfiguration(even_batches=False)
    acc = Accelerator(timeout=60, dataloader_config=config)
    global_arrays = getattr(acc._backend, "uneven_batches", True) is False
    try:
        loader = acc.prepare(unified.DataLoader(CountingDataset(13), batch_size=2))
    except Exception as err:  # the test tells a refusal from a failure by its type and message
        refused = _refusal(err, acc)
        try:
            _torch_loader(acc, 2)
        except Exception as torch_err:
            refused["torch_refused"], refused["torch_error"] = str(torch_err), type(torch_err).__name__
        return refused
    foreign = _torch_loader(acc, 2)
    epoch = [_rows(b) for b in loader]
    torch_epoch = None if foreign is None else [_rows(b) for b in foreign]
    target = _shared(f"uneven_ckpt_{acc.num_processes}")
    for i, _ in enumerate(loader):  # every process has at least 2 batches
        if i == 1:
            acc.save_state(target)
            break
    rest = [_rows(b) for b in loader] + [_rows(b) for b in loader]  # the epoch's rest, then the next
    fresh = Accelerator(timeout=60, dataloader_config=config)  # the same loaders, in the same order
    again = fresh.prepare(unified.DataLoader(CountingDataset(13), batch_size=2))
    _torch_loader(fresh, 2)
    fresh.load_state(target)
    resumed = [_rows(b) for b in again] + [_rows(b) for b in again]
    other = Accelerator(timeout=60, dataloader_config=config)  # and with Accelerate's skip_first_batches after it
    skipping = other.prepare(unified.DataLoader(CountingDataset(13), batch_size=2))
    _torch_loader(other, 2)
    other.load_state(target)
    resumed_with_skip = [_rows(b) for b in other.skip_first_batches(skipping, 2)] + [_rows(b) for b in skipping]
    return {"global_arrays": global_arrays, "epoch": epoch, "length": len(loader), "torch_epoch": torch_epoch,
            "torch_length": None if foreign is None else len(foreign), "rest": rest, "resumed": resumed,
            "resumed_with_skip": resumed_with_skip}


@scenario
def data_split_dispatch(state: dict) -> dict:
    """``DataLoaderConfiguration(dispatch_batches=True, split_batches=True)``: process 0 reads one
    batch of the loader (13 samples, ``batch_size=6``) a step and every process gets its slice
    (Accelerate's dispatcher), for unified's loader and a torch ``DataLoader``; a checkpoint in the
    middle of the epoch resumes with exactly the rest; a batch size that does not divide by the
    processes is refused with Accelerate's message. A backend whose step batches are one global
    array refuses dispatch in `prepare`, naming its own way."""
    config = unified.DataLoaderConfiguration(dispatch_batches=True, split_batches=True)
    acc = Accelerator(timeout=60, dataloader_config=config)
    global_arrays = getattr(acc._backend, "uneven_batches", True) is False
    dataset = CountingDataset(13)
    try:
        loader = acc.prepare(unified.DataLoader(dataset, batch_size=6))
    except Exception as err:  # the test tells a refusal from a failure by its type and message
        return _refusal(err, acc)
    foreign = _torch_loader(acc, 6)
    epoch, gathered = [], []
    for batch in loader:
        epoch.append(_rows(batch))
        gathered += np.asarray(acc.gather_for_metrics(batch["x"])).ravel().tolist()
    torch_epoch = None if foreign is None else [_rows(b) for b in foreign]
    target = _shared(f"split_ckpt_{acc.num_processes}")
    for i, _ in enumerate(loader):
        if i == 0:
            acc.save_state(target)
            break
    rest = [_rows(b) for b in loader] + [_rows(b) for b in loader]  # the epoch's rest, then the next
    fresh = Accelerator(timeout=60, dataloader_config=config)  # the same loaders, in the same order
    again_dataset = CountingDataset(13)
    again = fresh.prepare(unified.DataLoader(again_dataset, batch_size=6))
    _torch_loader(fresh, 6)
    fresh.load_state(target)
    resumed = [_rows(b) for b in again] + [_rows(b) for b in again]
    try:
        acc.prepare(unified.DataLoader(CountingDataset(13), batch_size=5))
        indivisible = None
    except Exception as err:
        indivisible = [type(err).__name__, str(err)]
    return {"global_arrays": global_arrays, "epoch": epoch, "length": len(loader), "gathered": gathered,
            "total_batch_size": loader.total_batch_size, "torch_epoch": torch_epoch,
            "torch_length": None if foreign is None else len(foreign),
            "reads": dataset.calls, "rest": rest, "resumed": resumed, "resumed_reads": again_dataset.calls,
            "indivisible": indivisible}

# -- experiment trackers (run at the end of the data groups) ---------------------------------------
TRACKED_STEPS = 3


TRACKER_PACKAGES = ("tensorboardX", "mlflow", "wandb")


@scenario
def tracking(state: dict) -> dict:
    """Every installed tracker: Python numbers and replicated 0-d framework arrays logged at 3
    steps, under logging_dir; only process 0 writes (the others import no tracker package);
    end_training closes the runs. The parent reads the files back (unified/testing/tracker_files.py)."""
    import sys

    from unified.backend.registry import backend_names, backend_spec
    from unified.tracking import available_trackers

    names = available_trackers()
    acc = Accelerator(timeout=60, log_with=names or None, project_dir=_shared("tracking"))
    frameworks = {backend_spec(name).framework for name in backend_names()}
    frameworks_before = sorted(f for f in frameworks if f in sys.modules)
    acc.init_trackers("conformance", config={"lr": 0.5, "layers": [2, 3], "name": "tiny"})
    framework_arrays = []
    for step in range(1, TRACKED_STEPS + 1):
        reduced = acc.reduce(acc._backend.from_numpy(np.array(float(step), dtype=np.float32)), "sum")
        framework_arrays.append(acc._backend.is_array(reduced))
        acc.log({"loss": 1.0 / step, "reduced": reduced, "count": 10 * step}, step=step)
    handles = {name: type(acc.get_tracker(name, unwrap=True)).__name__ for name in names}
    wrapped = {name: type(acc.get_tracker(name)).__name__ for name in names}
    writer = acc.get_tracker("tensorboard", unwrap=True) if "tensorboard" in names and acc.is_main_process else None
    started = [t.name for t in acc.trackers]
    acc.end_training()
    return {"names": names, "started": started, "handles": handles, "wrapped": wrapped,
            "framework_arrays": framework_arrays,
            "imported": sorted(m for m in TRACKER_PACKAGES if m in sys.modules),
            "frameworks_before": frameworks_before,
            "frameworks_after": sorted(f for f in frameworks if f in sys.modules),
            "writer_closed": writer is None or writer.file_writer is None,
            "after_end": [t.name for t in acc.trackers]}
