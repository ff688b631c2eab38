"""`ShardedArrays.begin_sharded_save`'s default: a backend that only has the synchronous
`save_sharded` writes its shards at the call, and an async save of sharded state still commits
through the background (every process's part reported, the shard files listed by the main
process) and loads back. Two ranks of the in-memory backend, on threads."""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, Mapping

import numpy as np

from unified.backend import ShardedArrays, ShardedLoad, ShardedRead

from .memory_backend import MemoryBackend, MemoryGroup, run_threads, unwrap


class Part(np.ndarray):
    """This rank's part of an array split across the ranks (what `is_sharded` recognizes)."""


def _part(values) -> Part:
    return np.asarray(values, dtype=np.float32).view(Part)


class SyncShardedBackend(MemoryBackend, ShardedArrays):
    """Every rank writes its own parts with NumPy (no pickle); no asynchronous write of its own."""

    sharded_format = "npy"
    writers: Dict[int, str] = {}  # rank -> the thread that wrote its parts

    def is_sharded(self, value: Any) -> bool:
        return isinstance(value, Part)

    def save_sharded(self, directory: str, arrays: Mapping[str, Any]) -> None:
        self.writers[self.process_index] = threading.current_thread().name
        os.makedirs(directory, exist_ok=True)
        for key, value in arrays.items():
            np.save(os.path.join(directory, f"{key}.{self.process_index}.npy"), np.asarray(value), allow_pickle=False)

    def load_sharded(self, directory: str, like: Mapping[str, Any], options: ShardedLoad) -> ShardedRead:
        # the plain read only: nothing hashed, nothing deferred, whatever ``options`` asks
        return ShardedRead({key: np.load(os.path.join(directory, f"{key}.{self.process_index}.npy"),
                                         allow_pickle=False).view(Part) for key in like})


class Table:
    def __init__(self, rank: int, value: float) -> None:
        self.w = _part([value + rank, value + rank + 0.5])

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        self.w = np.array(state["w"]).view(Part)


def test_async_save_of_sharded_arrays_on_a_backend_without_async_writes(tmp_path):
    group = MemoryGroup(2, timeout_default=10.0)
    group.backends = [SyncShardedBackend(group, rank) for rank in range(2)]
    SyncShardedBackend.writers.clear()
    final = str(tmp_path / "ckpt")

    def body(rank: int) -> Any:
        acc = group.accelerator(rank)
        table = Table(rank, 1.0)
        acc.register_for_checkpointing(table)
        acc.save_state(final, async_save=True)
        written_at_call = dict(SyncShardedBackend.writers)
        table.w = _part([50.0, 50.0])  # replaced after the call: not in the checkpoint
        acc.wait_for_checkpoint()
        acc.load_state(final)
        return written_at_call, table.w.tolist()

    results = unwrap(run_threads(2, body, deadline=30.0, group=group))
    for rank, (written_at_call, loaded) in enumerate(results):
        assert written_at_call[rank] == f"rank-{rank}"  # the default wrote in the calling thread
        assert loaded == [1.0 + rank, 1.5 + rank]
    manifest = json.load(open(os.path.join(final, "manifest.json")))
    assert {"sharded.npy/a0.0.npy", "sharded.npy/a0.1.npy"} <= set(manifest["files"])


class FailingShardedBackend(SyncShardedBackend):
    """Rank 1 cannot write its shards (a full disk)."""

    def save_sharded(self, directory: str, arrays: Mapping[str, Any]) -> None:
        if self.process_index == 1:
            raise OSError(28, "No space left on device")
        super().save_sharded(directory, arrays)


def _save_everywhere(tmp_path, async_save: bool) -> list:
    group = MemoryGroup(2, timeout_default=10.0)
    group.backends = [FailingShardedBackend(group, rank) for rank in range(2)]
    final = str(tmp_path / f"ckpt-{async_save}")

    def body(rank: int) -> Any:
        acc = group.accelerator(rank)
        acc.register_for_checkpointing(Table(rank, 1.0))
        try:
            acc.save_state(final, async_save=async_save)
            acc.wait_for_checkpoint()
        except Exception as err:  # noqa: BLE001 - the observation
            return f"{type(err).__name__}: {err}"
        return "saved"

    results = unwrap(run_threads(2, body, deadline=30.0, group=group))
    assert not os.path.exists(final)
    return results


def test_a_shard_write_that_fails_when_it_begins_fails_the_save_everywhere_with_its_reason(tmp_path):
    """The failure is carried to the background write and reported (it was a NameError: the
    closure outlived the ``except`` clause's variable)."""
    for async_save in (False, True):
        for result in _save_everywhere(tmp_path, async_save):
            assert result.startswith("CheckpointError") and "No space left on device" in result, (async_save, result)
