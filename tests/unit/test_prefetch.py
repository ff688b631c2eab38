"""`unified.DataLoader(prefetch=N)`: batches placed ahead in a background thread, positions of
checkpoints unchanged (a prefetched batch is not consumed), exceptions at the right batch, and a
producer that stops when the loop does."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from unified.data import DataLoader, PreparedDataLoader
from unified.data.prefetch import prefetched


class _Recording:
    """A stand-in backend that records which thread placed each batch."""

    process_index, num_processes, uneven_batches = 0, 1, True

    def __init__(self) -> None:
        self.placed_by = []

    def place_batch(self, batch):
        self.placed_by.append(threading.current_thread().name)
        return batch


def _loader(n=10, prefetch=2, batch_size=2):
    backend = _Recording()
    source = DataLoader(np.arange(n), batch_size=batch_size, shuffle=True, seed=3, prefetch=prefetch)
    return PreparedDataLoader(source, backend, None), backend


def test_same_batches_placed_in_the_background():
    loader, backend = _loader()
    plain, _ = _loader(prefetch=0)
    assert [b.tolist() for b in loader] == [b.tolist() for b in plain]
    assert set(backend.placed_by) == {"unified-prefetch"}


def test_the_position_counts_only_batches_the_loop_received():
    loader, _ = _loader()
    plain, _ = _loader(prefetch=0)
    expected = [b.tolist() for b in plain]
    seen = []
    for batch in loader:
        seen.append(batch.tolist())
        time.sleep(0.05)  # the producer runs ahead meanwhile
        assert loader.position == len(seen)
        if len(seen) == 2:
            state = loader.state_dict()
            break
    resumed, _ = _loader()
    resumed.load_state_dict(state)
    assert seen + [b.tolist() for b in resumed] == expected


def test_break_stops_the_producer():
    before = {t.name for t in threading.enumerate()}
    loader, _ = _loader(n=1000)
    for _ in loader:
        break
    deadline = time.time() + 5
    while any(t.name == "unified-prefetch" for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.01)
    assert "unified-prefetch" not in {t.name for t in threading.enumerate()} - before


def test_an_error_of_the_producer_is_raised_at_its_batch():
    def items():
        yield 1
        yield 2
        raise KeyError("sample 7")

    got = []
    with pytest.raises(KeyError, match="sample 7"):
        for item in prefetched(items(), depth=4):
            got.append(item)
    assert got == [1, 2]


def test_invalid_prefetch_values_are_clear_errors():
    with pytest.raises(ValueError, match="invalid-prefetch"):
        DataLoader(np.arange(4), prefetch=-1)
    with pytest.raises(ValueError, match="map-style datasets"):
        DataLoader(iter(range(4)), prefetch=2)
