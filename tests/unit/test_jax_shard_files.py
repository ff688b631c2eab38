"""JAX's sharded state in its object-store layout (`backends/jax/storage.py`: one safetensors file
per process, pieces named ``<array>@<offsets>``), in one process with four CPU devices (a child
process: the device count is fixed when JAX starts). Written under one placement, read under
others (another split dimension, fewer devices, replication over part of a mesh) exactly; the
file read whole is hashed in the same pass (the bytes on disk), a sliced read reports no hash
(the manager hashes those files); shapes, dtypes and pieces that do not fit are refused with
nothing returned."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

REPO = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, os, sys, tempfile
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from backends.jax.storage import holds_shard_files, own_pieces, read_shards, write_shards
from unified.checkpoint import safetensors_io
from unified.errors import CheckpointError

devices = np.array(jax.devices())
rows, two, grid = Mesh(devices, ("d",)), Mesh(devices[:2], ("d",)), Mesh(devices.reshape(2, 2), ("a", "b"))
w = np.arange(48, dtype=np.float32).reshape(8, 6)
b = (np.arange(48, dtype=np.float32).reshape(8, 6) / 7).astype(jnp.bfloat16)
saved = {"w": jax.device_put(w, NamedSharding(rows, P("d", None))),
         "b": jax.device_put(b, NamedSharding(grid, P(None, "a")))}  # replicated over "b": written once
folder = tempfile.mkdtemp()
pieces, info = own_pieces(saved, copy=True)
hashes = write_shards(folder, 0, pieces, info)
out = {"pieces": sorted(pieces), "b_info": info["b@0,3"], "holds": holds_shard_files(folder),
       "empty": write_shards(folder, 1, {}, {}), "files": sorted(os.listdir(folder))}
path = os.path.join(folder, "shard-00000.safetensors")
out["written_hash_is_disk"] = hashes["shard-00000.safetensors"] == safetensors_io.verify_file(
    path, os.path.getsize(path), hashes["shard-00000.safetensors"]["xxh3"])

def zeros(value, sharding):
    return jax.device_put(np.zeros(value.shape, value.dtype), sharding)

def exact(arrays):
    return (np.array_equal(np.asarray(arrays["w"]), w)
            and np.array_equal(np.asarray(arrays["b"]).astype(np.float32), b.astype(np.float32)))

same = {k: zeros(v, v.sharding) for k, v in saved.items()}
made, private_array = [], safetensors_io.private_array
def recorded(dtype, shape):
    made.append(private_array(dtype, shape))
    return made[-1]
safetensors_io.private_array = recorded
arrays, hashed = read_shards(folder, same)[:2]
safetensors_io.private_array = private_array
out["same"] = {"exact": exact(arrays), "hashed": hashed == hashes,
               "placed": all(arrays[k].sharding == same[k].sharding for k in same)}
# each device's array is made over the buffer its bytes were read into, not copied from it
out["over_the_buffers"] = sorted(shard.data.unsafe_buffer_pointer() for k in arrays for shard in arrays[k].addressable_shards) \
    == sorted(buffer.ctypes.data for buffer in made)
other = {"w": zeros(saved["w"], NamedSharding(two, P(None, "d"))), "b": zeros(saved["b"], NamedSharding(rows, P("d")))}
arrays, hashed = read_shards(folder, other)[:2]
out["other"] = {"exact": exact(arrays), "hashed": hashed,
                "placed": all(arrays[k].sharding == other[k].sharding for k in other)}

def refused(like, where=folder):
    try:
        read_shards(where, like)
    except CheckpointError as err:
        return str(err)
    return None

out["shape"] = refused({"w": jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(rows, P("d")))})
out["dtype"] = refused({"w": jax.device_put(np.zeros((8, 6), np.int32), NamedSharding(rows, P("d")))})
out["unknown"] = refused({"v": same["w"]})
out["nothing"] = refused({"w": same["w"]}, tempfile.mkdtemp())
# a piece missing: only the first row block of w written
gap = tempfile.mkdtemp()
write_shards(gap, 0, {"w@0,0": pieces["w@0,0"]}, {"w@0,0": info["w@0,0"]})
out["gap"] = refused({"w": same["w"]}, gap)
def lone_file(about):  # one piece of w (its first two rows) described by ``about``
    where = tempfile.mkdtemp()
    safetensors_io.write(os.path.join(where, "shard-00000.safetensors"), {"w@0,0": safetensors_io.export_numpy(w[:2])},
                         metadata={"UNIFIED_SHARDS": json.dumps(about)})
    return where
out["undescribed"] = refused({"w": same["w"]}, lone_file({}))
out["outside"] = refused({"w": same["w"]}, lone_file({"w@0,0": {"array": "w", "offsets": [7, 0], "global_shape": [8, 6]}}))

# Orbax's files in a folder, restored a group at a time as the load makes the arrays (issue 29)
import orbax.checkpoint as ocp
from backends.jax.storage import OrbaxGroups, uncompressed_pytree_handler
orbax_dir = os.path.join(tempfile.mkdtemp(), "sharded.orbax")
ocp.Checkpointer(uncompressed_pytree_handler(ocp)).save(orbax_dir, args=ocp.args.PyTreeSave(dict(saved)))
groups = OrbaxGroups(orbax_dir, same)
one_each = OrbaxGroups(orbax_dir, same, group_bytes=1)
deferred = one_each.deferred()
before = sorted(one_each._restored)
first = deferred["w"].make()
out["orbax"] = {"groups": groups.groups, "one_each": one_each.groups, "before": before,
                "after_first": sorted(one_each._restored), "w": np.array_equal(np.asarray(first), w),
                "placed": first.sharding == same["w"].sharding}
second = deferred["b"].make()
out["orbax"]["b"] = np.array_equal(np.asarray(second).astype(np.float32), b.astype(np.float32))
out["orbax"]["left"] = sorted(one_each._restored)

# On an object store with private local copies (issue 29): the file this process reads whole is
# streamed into the copy, hashed; its arrays come back deferred (no memory of their own yet) and
# are made, exact and placed, one at a time when the load restores them.
from unified.backend import DeferredArray
from unified.testing.object_store import missing_store_packages, s3_server
if not missing_store_packages():
    with s3_server() as server:
        url = server.bucket() + "/sharded"
        write_shards(url, 0, pieces, info)
        copies, asked = tempfile.mkdtemp(), []
        def copy_to(path, size):
            asked.append((path.rsplit("/", 1)[-1], size))
            return os.path.join(copies, f"copy-{len(asked)}")
        made.clear()
        safetensors_io.private_array = recorded
        deferred, hashed = read_shards(url, same, copy_to)[:2]
        before_make = len(made)
        store = {"deferred": sorted(k for k, v in deferred.items() if isinstance(v, DeferredArray)),
                 "memory_before_make": before_make, "hashed": hashed == hashes, "asked": asked,
                 "copied_bytes": os.path.getsize(os.path.join(copies, "copy-1"))}
        arrays = {k: v.make() for k, v in deferred.items()}
        safetensors_io.private_array = private_array
        store.update(exact=exact(arrays), placed=all(arrays[k].sharding == same[k].sharding for k in same),
                     made_at_make=len(made))
        sliced, hashed = read_shards(url, other, copy_to)[:2]  # slices of the file: read now, not deferred
        store["sliced"] = {"deferred": [k for k, v in sliced.items() if isinstance(v, DeferredArray)],
                           "exact": exact(sliced), "hashed": hashed}
        eager, hashed = read_shards(url, same, lambda path, size: None)[:2]  # no room for a copy: read now
        store["no_copy"] = {"deferred": [k for k, v in eager.items() if isinstance(v, DeferredArray)],
                            "exact": exact(eager), "hashed": hashed == hashes}
        # One pass (issue 48): nothing is read until the first array is made; then the file is
        # streamed once, hashed, with no local copy, each array handed over as soon as it is whole
        # (both here: the file holds both), and the rest made from what was handed over.
        handed, refused = [], lambda path, size: 1 / 0  # a local copy is never asked for
        streamed = read_shards(url, same, refused, stream_later=lambda key, array: handed.append(key))
        nothing_yet = {"handed": list(handed), "hashes": streamed.later_hashes()}
        first = streamed.arrays["w"].make()
        at_first = {"handed": sorted(handed), "hashes": streamed.later_hashes() == hashes}
        made_arrays = {"w": first, "b": streamed.arrays["b"].make()}
        store["stream"] = {"deferred": sorted(k for k, v in streamed.arrays.items() if isinstance(v, DeferredArray)),
                           "hashed_now": streamed.hashed, "later": list(streamed.later), "nothing_yet": nothing_yet,
                           "at_first": at_first, "exact": exact(made_arrays),
                           "placed": all(made_arrays[k].sharding == same[k].sharding for k in same)}
        sliced = read_shards(url, other, refused, stream_later=lambda key, array: handed.append(key))
        store["stream"]["sliced"] = {"deferred": [k for k, v in sliced.arrays.items() if isinstance(v, DeferredArray)],
                                     "exact": exact(sliced.arrays), "later": list(sliced.later)}
        # a byte flipped in the data: the arrays are made (the stream cannot know yet), its hash differs;
        # the object cut short: the make raises, naming the object, and so does every later make of it
        fs, key = server.filesystem(), url.split("://", 1)[1] + "/shard-00000.safetensors"
        good = fs.cat_file(key)
        fs.pipe_file(key, good[:-3] + bytes([good[-3] ^ 1]) + good[-2:])
        flipped = read_shards(url, same, refused, stream_later=lambda key, array: None)
        [flipped.arrays[k].make() for k in ("w", "b")]
        store["stream"]["flipped_hash_differs"] = flipped.later_hashes()["shard-00000.safetensors"]["xxh3"] != \
            hashes["shard-00000.safetensors"]["xxh3"]
        cut = read_shards(url, same, refused, stream_later=lambda key, array: None)
        fs.pipe_file(key, good[:len(good) // 2])
        errors = []
        for k in ("w", "b"):
            try:
                cut.arrays[k].make()
            except (CheckpointError, OSError) as err:
                errors.append(str(err))
        store["stream"]["cut"] = errors
        fs.pipe_file(key, good)
        out["store"] = store
print("RESULT " + json.dumps(out))
"""  # noqa: E501 - two long lines in the child script above: its text is a string, kept as it is


@pytest.fixture(scope="module")
def result():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_each_piece_is_written_once_by_the_process_holding_its_first_replica(result):
    assert result["pieces"] == ["b@0,0", "b@0,3", "w@0,0", "w@2,0", "w@4,0", "w@6,0"]
    assert result["b_info"] == {"array": "b", "offsets": [0, 3], "global_shape": [8, 6]}
    assert result["holds"] and result["empty"] == {} and result["files"] == ["shard-00000.safetensors"]
    assert result["written_hash_is_disk"]


def test_read_back_exactly_under_the_same_placement_hashed_in_the_same_pass(result):
    assert result["same"] == {"exact": True, "hashed": True, "placed": True}


def test_each_device_array_is_made_over_the_memory_it_was_read_into(result):
    # before: NumPy's 16-byte aligned buffers, which jax.device_put copied (0.28 s for 0.4 GB)
    assert result["over_the_buffers"]


def test_on_a_store_the_file_read_whole_goes_to_a_private_copy_and_its_arrays_are_made_when_restored(result):
    if "store" not in result:
        pytest.skip("moto's S3 server is not installed")
    store = result["store"]
    assert store["asked"] == [["shard-00000.safetensors", store["copied_bytes"]]]
    assert store["hashed"] and store["deferred"] == ["b", "w"]
    # before: every region's memory was made while the file streamed in (the process's second copy)
    assert store["memory_before_make"] == 0 and store["made_at_make"] == 6
    assert store["exact"] and store["placed"]
    assert store["sliced"] == {"deferred": [], "exact": True, "hashed": {}}
    assert store["no_copy"] == {"deferred": [], "exact": True, "hashed": True}


def test_in_one_pass_the_store_file_is_streamed_once_when_its_first_array_is_made(result):
    if "store" not in result:
        pytest.skip("moto's S3 server is not installed")
    stream = result["store"]["stream"]
    assert stream["deferred"] == ["b", "w"] and stream["hashed_now"] == {}
    assert stream["later"] == ["shard-00000.safetensors"]
    assert stream["nothing_yet"] == {"handed": [], "hashes": {}}  # nothing read before the first make
    # the first make streamed the whole file once: both arrays handed over, the file hashed
    assert stream["at_first"] == {"handed": ["b", "w"], "hashes": True}
    assert stream["exact"] and stream["placed"]
    # slices of the file (another placement) are read now, as without one pass
    assert stream["sliced"] == {"deferred": [], "exact": True, "later": []}
    assert stream["flipped_hash_differs"]
    assert len(stream["cut"]) == 2 and all("shard-00000.safetensors" in e for e in stream["cut"])


def test_orbax_s_files_in_a_folder_are_restored_a_group_at_a_time_when_made(result):
    orbax = result["orbax"]
    assert orbax["groups"] == [["w", "b"]]  # both within one group's bytes: one Orbax call
    assert orbax["one_each"] == [["w"], ["b"]]
    assert orbax["before"] == orbax["after_first"] == orbax["left"] == []  # each restored when made, none kept
    assert orbax["w"] and orbax["b"] and orbax["placed"]


def test_read_back_exactly_under_another_placement_in_slices(result):
    assert result["other"] == {"exact": True, "hashed": {}, "placed": True}


@pytest.mark.parametrize("case, words", [
    ("shape", "has the shape (8, 6) there and (8, 4) in this run"),
    ("dtype", "is stored as ['F32'] and is int32 in this run"),
    ("unknown", "holds no piece of 'v'"),
    ("nothing", "holds no shard file"),
    ("gap", "do not cover the part"),
    ("undescribed", "UNIFIED_SHARDS metadata does not describe its entries (KeyError"),
    ("outside", "w@0,0 does not fit in its array of shape (8, 6)"),
])
def test_what_does_not_fit_is_refused_naming_it(result, case, words):
    assert result[case] is not None and words in result[case] and "nothing was restored" in result[case]
    assert "docs/troubleshooting.md#" in result[case]
