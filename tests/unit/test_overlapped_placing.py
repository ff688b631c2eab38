"""Arrays handed off by a copy that runs while the next array is read (issue 48's GPU pipeline,
`safetensors_place.Overlapped`, `Replaceable.replace_async`): they take turns in two staging
buffers, a buffer is written again only once the copy from it was waited for, and the read
returns only once every copy was waited for, also when it fails.

The handles here stand in for a torch tensor on a GPU: their copy runs late (when waited for, or
on a thread of its own after a delay), so a staging buffer reused too early gives wrong values.
Without the wait before a buffer is reused (`Placing.memory_for`) the first tests fail."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from unified.backend import Replaceable
from unified.checkpoint import safetensors_io, safetensors_read
from unified.checkpoint.placement import _hand_off
from unified.checkpoint.safetensors_place import Overlapped
from unified.errors import CheckpointError

SIZES = {"a": (1000, np.float32), "b": ((20, 30), np.int64), "c": (777, np.uint8), "d": (5000, np.float64),
         "e": (3, np.int16), "f": (4096, np.float32)}


def _write(path):
    rng = np.random.default_rng(0)
    arrays = {key: (rng.integers(0, 100, shape) * 1.5).astype(dtype) for key, (shape, dtype) in SIZES.items()}
    arrays["bias"] = np.arange(5, dtype=np.float32)  # read into fresh memory
    info = safetensors_io.write(str(path), {k: safetensors_io.export_numpy(v) for k, v in arrays.items()})
    return arrays, info


class _LateCopy(Replaceable):
    """A live array filled by a copy that runs only when waited for (``late="wait"``) or on a
    thread of its own after a delay (``late="thread"``), reading the staging buffer then."""

    def __init__(self, like, log, late="wait", staging=None):
        self.target, self.log, self.late, self.staging = np.zeros_like(like), log, late, staging

    def current(self):
        return self.target

    def replace(self, host):
        self.target[...] = host

    @property
    def copies_while_reading(self):
        return True

    def staging_buffer(self, nbytes):
        if self.staging is None:
            return None
        buffer = np.empty(nbytes, np.uint8)
        self.staging.append(buffer)
        return buffer

    def replace_async(self, host):
        self.log["buffers"].add(host.ctypes.data)  # each array's view starts at its buffer's first byte
        self.log["outstanding"] += 1
        copier = None
        if self.late == "thread":
            copier = threading.Thread(target=lambda: (time.sleep(0.02), self.replace(host)))
            copier.start()

        def wait():
            if copier is None:
                self.replace(host)
            else:
                copier.join()
            self.log["outstanding"] -= 1

        return wait


def _log():
    return {"buffers": set(), "outstanding": 0}


def _read(reader, tmp_path, info, into):
    if reader == "folder":
        return safetensors_io.read_placed(str(tmp_path / "f.safetensors"), info["size"], info["xxh3"], into)
    with open(tmp_path / "f.safetensors", "rb") as handle:
        return safetensors_io.read_stream_placed(handle, "f", info["size"], info["xxh3"], into, chunk=1000)


@pytest.mark.parametrize("late", ["wait", "thread"])
@pytest.mark.parametrize("reader", ["folder", "stream"])
def test_every_array_gets_exactly_its_bytes_through_two_buffers_taking_turns(tmp_path, monkeypatch, reader, late):
    monkeypatch.setattr(safetensors_read, "_READ_CHUNK", 4096)
    arrays, info = _write(tmp_path / "f.safetensors")
    log = _log()
    handles = {key: _LateCopy(arrays[key], log, late) for key in SIZES}
    into = {key: _hand_off(handle) for key, handle in handles.items()}  # as `Placement._places` builds them
    assert all(isinstance(value, Overlapped) for value in into.values())
    fresh, placed = _read(reader, tmp_path, info, into)
    assert log["outstanding"] == 0  # every copy waited for before the read returned
    assert sorted(placed) == sorted(SIZES) and list(fresh) == ["bias"]
    assert np.array_equal(fresh["bias"], arrays["bias"])
    for key, handle in handles.items():
        assert handle.target.dtype == arrays[key].dtype and np.array_equal(handle.target, arrays[key]), key
    assert len(log["buffers"]) == 2


@pytest.mark.parametrize("reader", ["folder", "stream"])
def test_the_handles_staging_buffers_are_the_two_used(tmp_path, reader):
    arrays, info = _write(tmp_path / "f.safetensors")
    log, staging = _log(), []
    handles = {key: _LateCopy(arrays[key], log, staging=staging) for key in SIZES}
    _read(reader, tmp_path, info, {key: _hand_off(handle) for key, handle in handles.items()})
    assert len(staging) == 2 and all(buffer.nbytes == max(a.nbytes for k, a in arrays.items() if k in SIZES)
                                     for buffer in staging)
    assert log["buffers"] == {buffer.ctypes.data for buffer in staging}
    assert all(np.array_equal(handle.target, arrays[key]) for key, handle in handles.items())


@pytest.mark.parametrize("reader", ["folder", "stream"])
def test_a_checksum_mismatch_still_raises_once_every_copy_was_waited_for(tmp_path, reader):
    _, info = _write(tmp_path / "f.safetensors")
    with open(tmp_path / "f.safetensors", "r+b") as handle:
        handle.seek(info["size"] - 10)
        handle.write(b"\x01")
    log = _log()
    into = {key: _hand_off(_LateCopy(np.zeros(shape, dtype), log, "thread")) for key, (shape, dtype) in SIZES.items()}
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        _read(reader, tmp_path, info, into)
    assert log["outstanding"] == 0


def test_a_stream_that_ends_early_raises_its_error_once_every_copy_was_waited_for(tmp_path):
    _, info = _write(tmp_path / "f.safetensors")
    data = (tmp_path / "f.safetensors").read_bytes()
    (tmp_path / "f.safetensors").write_bytes(data[:-100])
    log = _log()
    into = {key: _hand_off(_LateCopy(np.zeros(shape, dtype), log, "thread")) for key, (shape, dtype) in SIZES.items()}
    with open(tmp_path / "f.safetensors", "rb") as handle, pytest.raises(CheckpointError, match="ended"):
        safetensors_io.read_stream_placed(handle, "f", info["size"], info["xxh3"], into)
    assert log["outstanding"] == 0


def test_a_failed_copy_is_raised_by_the_read_after_the_other_copy_was_waited_for(tmp_path):
    arrays, info = _write(tmp_path / "f.safetensors")
    log = _log()
    failing = _LateCopy(arrays["f"], log)

    def fails():
        log["outstanding"] -= 1
        raise RuntimeError("device lost")

    failing.replace_async = lambda host: (log["buffers"].add(host.ctypes.data), log.__setitem__(
        "outstanding", log["outstanding"] + 1), fails)[-1]
    into = {key: _hand_off(_LateCopy(arrays[key], log)) for key in SIZES if key != "f"}
    into["f"] = _hand_off(failing)
    with pytest.raises(RuntimeError, match="device lost"):
        _read("folder", tmp_path, info, into)
    assert log["outstanding"] == 0


def test_synchronous_and_kept_hand_offs_are_unchanged():
    class Plain(Replaceable):
        def current(self):
            return None

        def replace(self, host):
            pass

    class Kept(Plain):
        keeps_host = True

    plain, kept = Plain(), Kept()
    assert _hand_off(plain) == plain.replace and not isinstance(_hand_off(plain), Overlapped)
    assert isinstance(_hand_off(kept), safetensors_io.KeepsHost)
    host = np.ones(3)
    assert plain.replace_async(host) is None and plain.staging_buffer(24) is None  # the defaults


def test_an_overlapped_hand_off_called_plainly_waits_for_its_copy():
    log = _log()
    handle = _LateCopy(np.zeros(4, np.float32), log, "thread")
    _hand_off(handle)(np.full(4, 2.5, np.float32))
    assert log["outstanding"] == 0 and np.array_equal(handle.target, np.full(4, 2.5, np.float32))


def test_torch_fills_a_tensor_off_cuda_synchronously():
    torch = pytest.importorskip("torch")
    from backends.torch.core import _FilledOnDevice

    tensor = torch.zeros(6, dtype=torch.float32)  # the CUDA path needs a GPU: only its guard runs here
    handle = _FilledOnDevice(tensor)
    assert not handle.copies_while_reading and handle.staging_buffer(24) is None
    assert handle.replace_async(np.arange(6, dtype=np.float32)) is None
    assert torch.equal(tensor, torch.arange(6, dtype=torch.float32))
    assert not isinstance(_hand_off(handle), Overlapped)
