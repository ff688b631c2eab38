"""What `load_state` restores is what it verified, and no restored array shares memory with a
checkpoint file (issue 11, finding 4).

Files used to be verified, then mapped: a file rewritten after verification changed what was
restored, a file truncated meanwhile killed the process with SIGBUS, and on JAX restored
parameters kept sharing memory with the file. `tests/scripts/tamper_checkpoint.py` changes the
files at each of those moments, in a subprocess per backend so that a crash fails the test
instead of killing pytest.
"""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from unified.checkpoint import safetensors_io, safetensors_read
from unified.errors import CheckpointError

from ..conftest import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
CASES = [f"{how}-{when}" for when in ("after-verify", "during-read", "after-load") for how in ("rewrite", "truncate")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_changing_files_during_or_after_a_load_never_restores_unverified_bytes(backend):
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "tamper_checkpoint.py"), backend, *CASES],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    outcomes = {o["case"]: o
                for o in (json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("CASE "))}
    died = f" (killed by {signal.Signals(-run.returncode).name})" if run.returncode < 0 else ""
    assert run.returncode == 0, f"exit {run.returncode}{died} after {sorted(outcomes)}:\n{run.stderr[-3000:]}"
    assert sorted(outcomes) == sorted(CASES)
    for case, outcome in outcomes.items():
        if case.endswith("after-load"):  # the live state must not see the file change
            assert outcome == {"case": case, "raised": None, "state": "saved"}, outcome
        elif outcome["raised"] is None:  # the verified bytes were restored...
            assert outcome["state"] == "saved", outcome
        else:  # ...or a CheckpointError naming the file, with every object as it was
            assert ".safetensors" in outcome["raised"] and outcome["state"] == "before load", outcome


def _file(tmp_path, arrays):
    path = str(tmp_path / "f.safetensors")
    info = safetensors_io.write(path, {k: safetensors_io.export_numpy(v) for k, v in arrays.items()})
    return path, info


def test_restored_arrays_are_private_and_writable(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int64)}
    path, info = _file(tmp_path, arrays)
    back = safetensors_io.read(path, info["size"], info["xxh3"])
    with open(path, "r+b") as handle:  # the file changes after the read: the arrays do not
        handle.seek(info["size"] - 24)
        handle.write(b"\xff" * 24)
    assert back["b"].tolist() == [1, 1, 1] and back["a"].tolist() == arrays["a"].tolist()
    assert back["a"].flags.writeable and back["b"].flags.writeable
    back["a"][0, 0] = 7.0  # the objects may keep them: they belong to nobody else
    assert back["a"][0, 0] == 7.0 and back["b"].tolist() == [1, 1, 1]


def test_a_file_that_ends_early_while_it_is_read_is_a_checkpoint_error(tmp_path, monkeypatch):
    path, info = _file(tmp_path, {"a": np.arange(1000, dtype=np.float64)})
    real_preadv = os.preadv

    def shrinking(fd, buffers, offset, *args):  # the file is truncated between the size check and the read
        os.truncate(path, 100)
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", shrinking)
    with pytest.raises(CheckpointError, match=r"f\.safetensors: file ended after 100 of 8\d\d\d bytes"):
        safetensors_io.read(path, info["size"], info["xxh3"])


def test_a_file_rewritten_while_it_is_read_fails_its_checksum(tmp_path, monkeypatch):
    path, info = _file(tmp_path, {"a": np.arange(1 << 20, dtype=np.float64)})  # 8 MiB: several chunks
    real_preadv, calls = os.preadv, []

    def rewriting(fd, buffers, offset, *args):
        calls.append(offset)
        if len(calls) == 2:
            with open(path, "r+b") as handle:
                handle.seek(info["size"] - 8)
                handle.write(b"\x01" * 8)
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(safetensors_read, "_READ_CHUNK", 1 << 20)
    # one reader thread: with several, the last chunk could be read before the rewrite lands (on a
    # busy machine), and the read would then rightly pass
    monkeypatch.setattr(safetensors_read, "_READERS", 1)
    monkeypatch.setattr(os, "preadv", rewriting)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        safetensors_io.read(path, info["size"], info["xxh3"])
    assert len(calls) > 2


def test_the_checksum_covers_exactly_the_bytes_read(tmp_path):
    path, info = _file(tmp_path, {"a": np.arange(3 << 18, dtype=np.float32)})
    content = Path(path).read_bytes()
    assert info["xxh3"] == xxhash.xxh3_64_hexdigest(content) and info["size"] == len(content)
    back = safetensors_io.read(path, info["size"], info["xxh3"])
    assert np.array_equal(back["a"], np.arange(3 << 18, dtype=np.float32))


def test_the_writer_aligns_arrays_so_that_they_can_be_taken_over(tmp_path):
    """Arrays whose size is a multiple of 64 bytes start at multiples of 64 in the reader's memory
    (a JAX array takes memory over only then), whatever order the state lists them in, and the
    file stays standard safetensors."""
    from safetensors.numpy import load_file

    arrays = {"step": np.array(3, np.float32), "w": np.ones((16, 16), np.float32),
              "odd": np.arange(3, dtype=np.float64), "v": np.full(64, 2, np.float32), "flags": np.array([True, False])}
    path, info = _file(tmp_path, arrays)
    back = safetensors_io.read(path, info["size"], info["xxh3"])
    assert back["w"].ctypes.data % 64 == 0 and back["v"].ctypes.data % 64 == 0
    assert all(a.flags.aligned for a in back.values())
    for loaded in (back, load_file(path)):
        assert {k: v.tolist() for k, v in loaded.items()} == {k: v.tolist() for k, v in arrays.items()}


@pytest.mark.parametrize("second, data", [((4, 12), 12), ((12, 20), 20), ((8, 16), 20)],
                         ids=["overlap", "gap", "unused tail"])
def test_arrays_that_overlap_or_leave_bytes_unused_are_refused(second, data):
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": list(second)}}).encode()
    buffer = bytearray(struct.pack("<Q", len(header)) + header + bytes(data))
    with pytest.raises(CheckpointError, match="overlap or leave bytes"):
        safetensors_io.parse(buffer, "h.safetensors")


def test_short_reads_are_resumed_where_they_stopped(tmp_path, monkeypatch):
    """The kernel may return fewer bytes than asked: the rest is read, nothing is skipped."""
    arrays = {f"a{i}": np.arange(i * 1000, dtype=np.float32) for i in range(8)} | {"s": np.array(5, np.int64)}
    path, info = _file(tmp_path, arrays)
    real_preadv = os.preadv

    def stingy(fd, buffers, offset, *args):  # at most 1000 bytes per call
        budget, limited = 1000, []
        for buffer in buffers:
            if budget <= 0:
                break
            limited.append(buffer[:budget])
            budget -= len(limited[-1])
        return real_preadv(fd, limited, offset, *args)

    monkeypatch.setattr(os, "preadv", stingy)
    back = safetensors_io.read(path, info["size"], info["xxh3"])
    assert {k: v.tolist() for k, v in back.items()} == {k: v.tolist() for k, v in arrays.items()}
