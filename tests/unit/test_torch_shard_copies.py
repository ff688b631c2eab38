"""torch's sharded reader in bounded memory (issue 29, `backends/torch/storage.py`): the files a
process needs whole are hashed in a first pass that writes no tensor (a store's objects into
private local copies, a folder's files where they are, entry by entry too); each array comes
back deferred and fills the live tensor in place when made, refusing a folder's file that
changed since. On a store without room for a copy the reader fills fresh tensors as before and
leaves the live ones alone."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from backends.torch.sharding import TorchSharding  # noqa: E402
from backends.torch.storage import HashingWriter  # noqa: E402
from unified.backend import DeferredArray, ShardedLoad  # noqa: E402
from unified.checkpoint.store import headers_of  # noqa: E402
from unified.errors import CheckpointError  # noqa: E402
from unified.testing.object_store import missing_store_packages, s3_server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SAVED = {"w": torch.arange(6 * 1024, dtype=torch.float32).reshape(6, 1024), "b": torch.arange(7, dtype=torch.bfloat16)}


def _zeros():
    return {k: torch.zeros_like(v) for k, v in SAVED.items()}


def _load(where: str, like, copy_to=None):
    """The manager's hashed read, bounded (``defer``) when given ``copy_to``: (arrays, hashes)."""
    read = TorchSharding().load_sharded(where, like, ShardedLoad(hash_files=True, defer=copy_to is not None,
                                                                 copy_to=copy_to))
    return read.arrays, read.hashes


def _save(where: str):
    writer = HashingWriter(where)
    dcp.save(dict(SAVED), storage_writer=writer, no_dist=True)
    return writer.written


@pytest.fixture(scope="module")
def store():
    if missing_store_packages():
        pytest.skip(missing_store_packages())
    with s3_server() as server:
        url = server.bucket() + "/sharded.dcp"
        yield url, _save(url)


def test_objects_read_whole_are_copied_hashed_and_fill_the_live_tensors_in_place_when_made(store, tmp_path):
    url, written = store
    like, asked = _zeros(), []

    def copy_to(path, size):
        asked.append(os.path.basename(path))
        return str(tmp_path / f"copy-{len(asked)}")

    arrays, hashed = _load(url, like, copy_to=copy_to)
    assert hashed == written and asked == sorted(written)
    assert all(isinstance(v, DeferredArray) for v in arrays.values()) and sorted(arrays) == ["b", "w"]
    assert all(not v.any() for v in like.values())  # nothing written before the load puts them in place
    for key, value in arrays.items():
        made = value.make()
        assert made is like[key] and torch.equal(made, SAVED[key])


def test_without_room_for_a_copy_fresh_tensors_are_filled_and_the_live_ones_left_alone(store, monkeypatch):
    from backends.torch import storage

    url, written = store
    like, asked = _zeros(), []
    monkeypatch.setattr(storage, "headers_of", lambda paths, *rest: asked.append(paths) or headers_of(paths, *rest))
    arrays, hashed = _load(url, like, copy_to=lambda path, size: None)
    assert len(asked) == 1  # the objects' headers asked for once, though the load planned twice
    assert hashed == written and not any(isinstance(v, DeferredArray) for v in arrays.values())
    assert all(torch.equal(arrays[k], SAVED[k]) and arrays[k] is not like[k] for k in SAVED)
    assert all(not v.any() for v in like.values())


def test_without_a_bounded_load_asked_for_a_folder_is_read_into_fresh_tensors(tmp_path):
    folder = str(tmp_path / "sharded.dcp")
    written = _save(folder)
    like = _zeros()
    arrays, hashed = _load(folder, like)
    assert hashed == written and not any(isinstance(v, DeferredArray) for v in arrays.values())
    assert all(torch.equal(arrays[k], SAVED[k]) for k in SAVED) and all(not v.any() for v in like.values())


def test_a_folder_s_files_are_hashed_where_they_are_and_fill_the_live_tensors_in_place_when_made(tmp_path):
    folder = str(tmp_path / "sharded.dcp")
    written = _save(folder)
    like = _zeros()
    arrays, hashed = _load(folder, like, copy_to=lambda path, size: str(tmp_path / "x"))
    assert hashed == written and all(isinstance(v, DeferredArray) for v in arrays.values())
    assert all(not v.any() for v in like.values()) and not os.path.exists(tmp_path / "x")  # no copy of a folder's file
    for key, value in arrays.items():
        made = value.make()
        assert made is like[key] and torch.equal(made, SAVED[key])


@pytest.mark.parametrize("identity_tells", [True, False])
def test_a_folder_s_file_that_changed_after_the_first_pass_is_refused_when_made(tmp_path, monkeypatch, identity_tells):
    from unified.checkpoint import safetensors_io

    folder = str(tmp_path / "sharded.dcp")
    _save(folder)
    like = _zeros()
    arrays, _ = _load(folder, like, copy_to=lambda path, size: None)
    (name,) = os.listdir(folder)
    with open(os.path.join(folder, name), "r+b") as handle:  # the last byte of the last entry
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))
    if not identity_tells:  # a file system whose times are too coarse to show it: the bytes tell
        monkeypatch.setattr(safetensors_io, "changed_since", lambda path, seen: False)
    with pytest.raises(CheckpointError, match="changed after it was verified" if identity_tells else "changed while"):
        for value in arrays.values():
            value.make()


def _one_pass(where: str, like, copy_to=None):
    return TorchSharding().load_sharded(where, like, ShardedLoad(hash_files=True, defer=True, copy_to=copy_to,
                                                                 hash_when_placed=True))


@pytest.mark.parametrize("location", ["folder", "store"])
def test_one_pass_reads_each_file_once_straight_into_the_live_tensors_and_hashes_it_then(
        location, store, tmp_path, monkeypatch):
    """``hash_when_placed`` (issue 48): nothing is hashed or copied when the load plans; the first
    array made reads its whole file into every live tensor it holds, hashed in that pass, and
    the hashes come once the arrays are made (each file read once: before, hashed first and
    read again)."""
    from unified.checkpoint import safetensors_io

    if location == "folder":
        where = str(tmp_path / "sharded.dcp")
        written = _save(where)
    else:
        where, written = store
    reads = []
    real_read_into = safetensors_io.read_into
    monkeypatch.setattr(safetensors_io, "read_into", lambda path, *a: reads.append(path) or real_read_into(path, *a))
    monkeypatch.setattr(safetensors_io, "hash_entries", lambda *a: pytest.fail("hashed before it was placed"))
    like, asked = _zeros(), []
    read = _one_pass(where, like, copy_to=lambda path, size: asked.append(path))
    assert read.hashes == {} and read.hashed_later == tuple(sorted(written)) and read.later_hashes() == {}
    assert asked == [] and all(not v.any() for v in like.values())  # no copy, nothing filled yet
    for key in sorted(read.arrays):
        made = read.arrays[key].make()
        assert made is like[key] and torch.equal(made, SAVED[key])
    assert read.later_hashes() == written
    assert len(reads) == (1 if location == "folder" else 0)  # the file read once (a store's streamed once)


def test_one_pass_gives_the_hash_of_a_damaged_file_as_it_is_and_the_manager_compares_it(tmp_path):
    folder = str(tmp_path / "sharded.dcp")
    written = _save(folder)
    (name,) = os.listdir(folder)
    with open(os.path.join(folder, name), "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))
    like = _zeros()
    read = _one_pass(folder, like)
    for value in read.arrays.values():
        value.make()
    got = read.later_hashes()[name]
    assert got["size"] == written[name]["size"] and got["xxh3"] != written[name]["xxh3"]
