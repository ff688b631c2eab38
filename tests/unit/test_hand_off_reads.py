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

from unified.checkpoint import codec, safetensors_io
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
