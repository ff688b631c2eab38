"""Property-based tests (Hypothesis) of the manifest reader and the checkpoint directory scanner."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unified.checkpoint import layout
from unified.checkpoint.manifest import MANIFEST, read_manifest, write_manifest
from unified.errors import CheckpointError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@SETTINGS
@given(st.binary(max_size=400) | json_values.map(lambda v: json.dumps(v).encode()))
def test_manifest_reader_never_crashes_on_arbitrary_bytes(raw):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, MANIFEST), "wb") as f:
            f.write(raw)
        try:
            read_manifest(d)
        except CheckpointError as err:
            assert MANIFEST in str(err) or d in str(err)
        else:  # only a properly signed manifest may be accepted; random bytes never are
            raise AssertionError(f"accepted arbitrary manifest bytes: {raw[:60]!r}")


@SETTINGS
@given(files=st.dictionaries(st.text(min_size=1, max_size=12), st.integers(0, 10**6), max_size=5),
       iteration=st.integers(0, 10**6))
def test_manifest_round_trip_and_names_that_could_escape_are_refused(files, iteration):
    body = {"backend": "torch", "num_processes": 1, "iteration": iteration, "objects": [],
            "structures": {}, "files": {n: {"size": s, "xxh3": "0" * 16} for n, s in files.items()}}
    # plain names, or '/'-separated plain names below the checkpoint (sharded files live in folders)
    safe = all(all(part not in ("", ".", "..") and all(c.isalnum() or c in "_.-" for c in part)
                   for part in n.split("/"))
               and c_ascii(n) for n in files)
    with tempfile.TemporaryDirectory() as d:
        write_manifest(d, body)
        try:
            manifest = read_manifest(d)
        except CheckpointError as err:
            assert not safe, err
            assert "refusing file name" in str(err)
        else:
            assert safe
            assert manifest["iteration"] == iteration and set(manifest["files"]) == set(files)


def c_ascii(name: str) -> bool:
    return name.isascii()


entry_names = st.one_of(
    st.integers(0, 30).map(lambda n: f"checkpoint_{n}"),
    st.integers(0, 30).map(lambda n: f".checkpoint_{n}.tmp-abc"),
    st.integers(0, 30).map(lambda n: f".checkpoint_{n}.old-abc"),
    st.sampled_from(["checkpoint_", "checkpoint_x", "checkpoint_-1", "notes.txt", "checkpoint_007"]),
)


@SETTINGS
@given(entries=st.lists(st.tuples(entry_names, st.booleans()), max_size=12), limit=st.integers(1, 4))
def test_scanner_orders_numerically_and_retention_keeps_the_newest(entries, limit):
    with tempfile.TemporaryDirectory() as folder:
        for name, complete in entries:
            path = os.path.join(folder, name)
            if name.endswith(".txt"):
                open(path, "w").close()
                continue
            os.makedirs(path, exist_ok=True)
            if complete:
                open(os.path.join(path, MANIFEST), "w").close()
        found = layout.numbered_checkpoints(folder)
        numbers = [n for n, _ in found]
        assert numbers == sorted(numbers)
        for _, path in found:  # only committed, well-named directories
            name = os.path.basename(path)
            assert not name.startswith(".") and os.path.isfile(os.path.join(path, MANIFEST))
            assert name == f"checkpoint_{int(name.split('_')[1])}" or name.startswith("checkpoint_0")
        highest = layout.highest_number(folder)
        if found:
            assert highest is not None and highest >= numbers[-1]
        if found:
            keep = found[-1][1]
            removed = layout.apply_retention(folder, limit, keep=keep)
            left = layout.numbered_checkpoints(folder)
            assert os.path.isdir(keep)
            assert len(left) == min(len(found), limit)
            assert [n for n, _ in left] == numbers[len(numbers) - len(left):]
            assert all(not os.path.exists(p) for p in removed)
        shutil.rmtree(folder, ignore_errors=True)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=5), st.booleans())
def test_live_writes_hash_exactly_the_bytes_they_write(sizes, live):
    """Both writers (live memory through bounce buffers, and the direct one) produce standard
    safetensors whose recorded checksum is that of the file, with several chunks per array."""
    import unittest.mock

    from unified.checkpoint import safetensors_io, safetensors_write

    arrays = {f"a{i}": np.arange(n, dtype=np.float32) * (i + 1) for i, n in enumerate(sizes)}
    exported = {k: safetensors_io.export_numpy(v) for k, v in arrays.items()}
    path = os.path.join(tempfile.mkdtemp(), "f.safetensors")
    with unittest.mock.patch.object(safetensors_write, "_LIVE_CHUNK", 1000), \
            unittest.mock.patch.object(safetensors_write, "_LIVE_BUFFERS", 2):
        info = safetensors_io.write(path, exported, live=live)
    assert safetensors_io.verify_file(path, info["size"], info["xxh3"]) == info
    back = safetensors_io.read(path, info["size"], info["xxh3"])
    assert {k: v.tolist() for k, v in back.items()} == {k: v.tolist() for k, v in arrays.items()}
    shutil.rmtree(os.path.dirname(path))
