"""`safetensors_io.read_placed` / `read_stream_placed` with hand-offs (a JAX load replaces each
live array, `Placing`): the arrays are read in file order through one staging buffer, each handed
off once its bytes are read, with what was written; and `codec.encode` frees the state's arrays
as soon as nobody holds them (a reference cycle kept them until the garbage collector ran, so a
load could not free the arrays it replaces one at a time)."""
from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pytest
import xxhash

from unified.checkpoint import codec, safetensors_io, safetensors_place, safetensors_read
from unified.errors import CheckpointError


def _write(path):
    arrays = {"a": np.arange(1000, dtype=np.float32), "b": np.full((20, 30), 7, np.int64),
              "c": np.arange(6, dtype=np.float64).reshape(2, 3), "d": np.zeros(0, np.float32)}
    info = safetensors_io.write(str(path), {k: safetensors_io.export_numpy(v) for k, v in arrays.items()})
    return arrays, info


def _file_order(path):
    with open(path, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda key: header[key]["data_offsets"][0])


@pytest.mark.parametrize("reader", ["folder", "stream"])
def test_hand_offs_get_each_array_in_file_order_through_one_buffer(tmp_path, reader):
    arrays, info = _write(tmp_path / "f.safetensors")
    got, buffers = [], set()

    def hand_off(key):
        def take(view):
            got.append((key, view.copy()))
            buffers.add(view.__array_interface__["data"][0])  # every view starts at the staging buffer
        return take

    into = {"a": hand_off("a"), "b": hand_off("b"), "d": hand_off("d")}
    if reader == "folder":
        fresh, placed = safetensors_io.read_placed(str(tmp_path / "f.safetensors"), info["size"], info["xxh3"], into)
    else:
        with open(tmp_path / "f.safetensors", "rb") as handle:
            fresh, placed = safetensors_io.read_stream_placed(handle, "f", info["size"], info["xxh3"], into)
    assert sorted(placed) == ["a", "b", "d"] and list(fresh) == ["c"]
    assert np.array_equal(fresh["c"], arrays["c"])
    assert [key for key, _ in got] == [k for k in _file_order(tmp_path / "f.safetensors") if k in into]
    assert all(np.array_equal(value, arrays[key]) and value.dtype == arrays[key].dtype for key, value in got)
    assert len(buffers) == 1


def test_a_damaged_file_still_fails_its_checksum_after_the_hand_offs(tmp_path):
    _, info = _write(tmp_path / "f.safetensors")
    with open(tmp_path / "f.safetensors", "r+b") as handle:
        handle.seek(info["size"] - 10)
        handle.write(b"\x01")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        safetensors_io.read_placed(str(tmp_path / "f.safetensors"), info["size"], info["xxh3"],
                                   {"a": lambda view: None, "b": lambda view: None})


def test_encode_keeps_no_array_alive_once_its_result_is_dropped():
    gc.disable()
    try:
        weight = np.ones(4)
        alive = weakref.ref(weight)
        result = codec.encode({"w": weight, "nested": {"x": [1, 2]}}, lambda x: False, "model")
        del weight, result
        assert alive() is None  # freed by reference counting, without the garbage collector
        weight = np.ones(4)
        alive = weakref.ref(weight)
        structure, arrays = codec.encode({"w": weight}, lambda x: False, "model")
        state = codec.decode(structure, arrays, lambda a: a)
        del weight, arrays, state
        assert alive() is None
    finally:
        gc.enable()


def _write_many(path, count, elements):
    arrays = {f"w{i:02d}": np.full(elements, i, np.float32) for i in range(count)}
    arrays.update({"bias": np.arange(5, dtype=np.float32), "empty": np.zeros(0, np.float32)})
    info = safetensors_io.write(str(path), {k: safetensors_io.export_numpy(v) for k, v in arrays.items()})
    return arrays, info


@pytest.mark.parametrize("reader", ["folder", "stream"])
def test_kept_hand_offs_get_memory_of_their_own_made_just_before_they_are_read(tmp_path, reader, monkeypatch):
    """A `KeepsHost` hand-off keeps the array itself (a JAX CPU array made over its memory), so
    each gets memory of its own that is never written again, in file order; the folder reader
    (threads reading ahead) makes at most its read-ahead's worth of them before handing off."""
    monkeypatch.setattr(safetensors_read, "_READ_CHUNK", 1 << 20)
    monkeypatch.setattr(safetensors_read, "_READ_AHEAD", 4 << 20)
    monkeypatch.setattr(safetensors_read, "_READERS", 2)
    made, handed, most_ahead = [], [], [0]
    arrays, info = _write_many(tmp_path / "f.safetensors", 24, 1 << 18)  # 24 arrays of 1 MiB
    private = safetensors_io.private_array

    def counted(dtype, shape):
        array = private(dtype, shape)
        made.append(array.ctypes.data)
        most_ahead[0] = max(most_ahead[0], len(made) - len(handed))
        return array

    monkeypatch.setattr(safetensors_place, "private_array", counted)

    def keep(key):
        return safetensors_io.KeepsHost(lambda array: handed.append((key, array)))

    into = {key: keep(key) for key in arrays if key.startswith("w")}
    if reader == "folder":
        fresh, placed = safetensors_io.read_placed(str(tmp_path / "f.safetensors"), info["size"], info["xxh3"], into)
    else:
        with open(tmp_path / "f.safetensors", "rb") as handle:
            fresh, placed = safetensors_io.read_stream_placed(handle, "f", info["size"], info["xxh3"], into)
    assert sorted(placed) == sorted(into) and sorted(fresh) == ["bias", "empty"]
    assert [key for key, _ in handed] == [k for k in _file_order(tmp_path / "f.safetensors") if k in into]
    # each kept array still holds its own values once the whole file was read: nothing reused its memory
    assert all(np.array_equal(array, arrays[key]) for key, array in handed)
    assert len({array.ctypes.data for _, array in handed}) == len(into)
    assert most_ahead[0] <= 4 + 2 + 2, most_ahead  # read-ahead / array size, the batch being gathered, fresh ones


def test_hand_offs_follow_the_hashing_with_tiny_and_empty_arrays_between(tmp_path, monkeypatch):
    """The folder reader batches tiny arrays into one read; each kept array is handed off only
    once its last byte was hashed, also when it ends inside such a batch."""
    monkeypatch.setattr(safetensors_read, "_READ_CHUNK", 1 << 16)
    arrays = {}
    for i in range(40):
        arrays[f"t{i:02d}"] = np.full(3 + i, i, np.int32)
        arrays[f"k{i:02d}"] = np.full(5000 * (i % 4 + 1), -i, np.float32)
        arrays[f"e{i:02d}"] = np.zeros(0, np.float64)
    info = safetensors_io.write(str(tmp_path / "f.safetensors"),
                                {k: safetensors_io.export_numpy(v) for k, v in arrays.items()})
    hashed_before, handed = [], []
    real = xxhash.xxh3_64

    class Counting:
        def __init__(self):
            self.digest, self.count = real(), 0

        def update(self, data):
            self.digest.update(data)
            self.count += len(data)

        def hexdigest(self):
            return self.digest.hexdigest()

    counter = Counting()
    monkeypatch.setattr(xxhash, "xxh3_64", lambda *a: counter)
    into = {key: safetensors_io.KeepsHost(lambda array, key=key: (handed.append((key, array.copy())),
                                                                   hashed_before.append(counter.count)))
            for key in arrays if key[0] in "ke"}
    fresh, placed = safetensors_io.read_placed(str(tmp_path / "f.safetensors"), info["size"], info["xxh3"], into)
    order = [k for k in _file_order(tmp_path / "f.safetensors")]
    assert [key for key, _ in handed] == [k for k in order if k in into]
    assert all(np.array_equal(value, arrays[key]) for key, value in handed)
    assert all(np.array_equal(fresh[key], arrays[key]) for key in arrays if key.startswith("t"))
    with open(tmp_path / "f.safetensors", "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    # bytes of the file hashed when each was handed off: at least up to its last byte
    assert all(count >= 8 + length + header[key]["data_offsets"][1] for (key, _), count in zip(handed, hashed_before))
