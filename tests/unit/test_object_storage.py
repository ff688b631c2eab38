"""Checkpoints in object storage (issue 29), on a real S3-compatible server started on loopback
(moto's standalone server, the one s3fs's own tests run against): a URL works wherever a folder
does (save_state, load_state, automatic naming, total_limit, load_state() of the newest); the
manifest, written last, is the commit; damaged, missing and half-written checkpoints are refused
or ignored, never loaded. Before, URLs were refused (and before that, written into a local folder
named ``s3:``)."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest

from unified.checkpoint import safetensors_io
from unified.checkpoint.store import ObjectStore, location_of
from unified.errors import CheckpointError
from unified.testing.object_store import missing_store_packages

pytestmark = pytest.mark.skipif(missing_store_packages() is not None, reason=str(missing_store_packages()))






@pytest.fixture
def accelerator_of():
    """``make(**kwargs)``: a one-process torch Accelerator with a model and an optimizer prepared
    (ended after the test)."""
    torch = pytest.importorskip("torch")
    from unified import Accelerator

    made = []

    def make(**kwargs):
        acc = Accelerator(backend="torch", **kwargs)
        torch.manual_seed(0)
        model = acc.prepare(torch.nn.Linear(4, 3))
        optimizer = acc.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
        made.append(acc)
        return acc, model, optimizer

    yield make
    for acc in made:
        acc.end_training()


def _step(acc, model, optimizer):
    import torch

    loss = model(torch.ones(2, 4)).sum()
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_streamed_files_are_the_files_the_folder_writer_writes(tmp_path):
    arrays = {"w": safetensors_io.export_numpy(np.arange(12, dtype=np.float32).reshape(3, 4)),
              "b": safetensors_io.export_numpy(np.arange(3, dtype=np.int64)),
              "odd": safetensors_io.export_numpy(np.arange(5, dtype=np.uint8))}
    streamed = io.BytesIO()
    info = safetensors_io.write_stream(streamed, arrays, chunk=7)  # chunks smaller than an array
    assert info == safetensors_io.write(str(tmp_path / "f.safetensors"), arrays)
    assert streamed.getvalue() == (tmp_path / "f.safetensors").read_bytes()
    back = safetensors_io.read_stream(io.BytesIO(streamed.getvalue()), "f", info["size"], info["xxh3"], chunk=5)
    assert (np.array_equal(back["w"], np.arange(12, dtype=np.float32).reshape(3, 4))
            and back["odd"].tolist() == [0, 1, 2, 3, 4])
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        damaged = bytearray(streamed.getvalue())
        damaged[-1] ^= 1
        safetensors_io.read_stream(io.BytesIO(bytes(damaged)), "f", info["size"], info["xxh3"])
    with pytest.raises(CheckpointError, match="ended"):
        safetensors_io.read_stream(io.BytesIO(streamed.getvalue()[:-3]), "f", info["size"], info["xxh3"])


def test_save_state_and_load_state_round_trip_through_s3(bucket, accelerator_of, tmp_path, monkeypatch):
    url, fs = bucket
    monkeypatch.chdir(tmp_path)
    acc, model, optimizer = accelerator_of()
    _step(acc, model, optimizer)
    saved = _params(model)
    assert acc.save_state(f"{url}/run/last") == f"{url}/run/last"
    listed = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/run/last"))
    assert "manifest.json" in listed and "model_0.safetensors" in listed and "rng_0.safetensors" in listed
    _step(acc, model, optimizer)
    assert not _same(_params(model), saved)
    assert acc.load_state(f"{url}/run/last") == f"{url}/run/last"
    assert _same(_params(model), saved)
    assert os.listdir(tmp_path) == []  # nothing written locally (no folder named "s3:")


def test_automatic_naming_keeps_total_limit_when_save_state_returns_and_loads_the_newest(bucket, accelerator_of):
    from unified import ProjectConfiguration

    url, fs = bucket
    config = ProjectConfiguration(project_dir=f"{url}/run", automatic_checkpoint_naming=True, total_limit=2)
    acc, model, optimizer = accelerator_of(project_config=config)
    assert acc.load_state(if_exists=True) is None  # nothing there yet: a fresh start
    for _ in range(3):
        _step(acc, model, optimizer)
        acc.save_state()
    newest = _params(model)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/run/checkpoints"))
    assert names == ["checkpoint_1", "checkpoint_2"]  # retention ran before save_state returned
    _step(acc, model, optimizer)
    later, model2, _ = accelerator_of(project_config=ProjectConfiguration(
        project_dir=f"{url}/run", automatic_checkpoint_naming=True, total_limit=2))
    assert later.load_state() == f"{url}/run/checkpoints/checkpoint_2"
    assert _same(_params(model2), newest)
    assert later.project_configuration.iteration == 3  # the next save never collides


def test_a_save_that_never_committed_is_ignored_then_cleaned_up(bucket, accelerator_of, monkeypatch):
    from unified import ProjectConfiguration

    url, fs = bucket
    config = ProjectConfiguration(project_dir=f"{url}/run", automatic_checkpoint_naming=True)
    acc, model, optimizer = accelerator_of(project_config=config)
    acc.save_state()
    kept = _params(model)
    _step(acc, model, optimizer)

    def lost(*args, **kwargs):  # the process dies before its manifest is written: files, no commit
        raise OSError("connection lost")

    monkeypatch.setattr(ObjectStore, "commit", lost)
    monkeypatch.setattr(ObjectStore, "discard", lambda self, staging: None)  # as if killed: nothing cleaned up
    with pytest.raises(CheckpointError, match="was not committed"):
        acc.save_state()
    assert fs.exists(f"{url}/run/checkpoints/checkpoint_1/model_0.safetensors")  # written, never committed
    monkeypatch.undo()
    fresh, model2, _ = accelerator_of(project_config=ProjectConfiguration(project_dir=f"{url}/run",
                                                                          automatic_checkpoint_naming=True))
    assert fresh.load_state() == f"{url}/run/checkpoints/checkpoint_0"  # the half-written one is never loaded
    assert _same(_params(model2), kept)
    assert fresh.save_state() == f"{url}/run/checkpoints/checkpoint_2"  # past the leftover, never onto it
    # deleted under the run's lease (S3); without one (gs://) it may be another live run's save: kept (issue 46)
    left = (["checkpoint_0", "checkpoint_2"] if url.startswith("s3://")
            else ["checkpoint_0", "checkpoint_1", "checkpoint_2"])
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{url}/run/checkpoints")) == left


@pytest.mark.parametrize("damage", ["flipped", "missing", "manifest"])
def test_a_damaged_or_missing_object_is_refused_naming_it_and_nothing_is_restored(bucket, accelerator_of, damage):
    url, fs = bucket
    acc, model, optimizer = accelerator_of()
    acc.save_state(f"{url}/ckpt")
    key = f"{url}/ckpt/{'manifest.json' if damage == 'manifest' else 'model_0.safetensors'}"
    if damage == "missing":
        fs.rm(key)
    else:
        data = bytearray(fs.cat_file(key))
        data[len(data) // 2] ^= 1
        fs.pipe_file(key, bytes(data))
    _step(acc, model, optimizer)
    before = _params(model)
    with pytest.raises(CheckpointError, match="model_0.safetensors|manifest.json") as caught:
        acc.load_state(f"{url}/ckpt")
    assert key.split("://")[1] in str(caught.value)
    assert _same(_params(model), before)


def test_refusals_say_what_to_do_and_write_nothing(bucket, accelerator_of, tmp_path, monkeypatch):
    url, fs = bucket
    monkeypatch.chdir(tmp_path)
    acc, model, optimizer = accelerator_of()
    acc.save_state(f"{url}/ckpt")
    with pytest.raises(CheckpointError, match="cannot replace one atomically"):
        acc.save_state(f"{url}/ckpt")  # a second save to the same prefix: the old one stays whole
    with pytest.raises(ValueError, match="object-storage URL.*object-storage-url"):
        acc.save_model(model, f"{url}/model")
    with pytest.raises(ImportError, match="fsspec client of nosuch://"):
        acc.save_state("nosuch://bucket/x")
    assert not fs.exists(f"{url}/model")
    assert os.listdir(tmp_path) == []
    acc.load_state(f"{url}/ckpt")  # still whole


def test_project_dir_may_be_a_url_and_local_paths_are_unchanged(tmp_path):
    from unified.config import ProjectConfiguration

    assert ProjectConfiguration(project_dir="s3://bucket/run").project_dir == "s3://bucket/run"
    assert ProjectConfiguration(project_dir=tmp_path).project_dir == str(tmp_path)
    assert ProjectConfiguration(project_dir="runs/s3:odd").project_dir == "runs/s3:odd"
    assert isinstance(location_of("s3://bucket/run"), ObjectStore)


def test_a_store_load_downloads_each_object_once_into_place_and_verify_first_reads_a_local_copy(
        bucket, accelerator_of, monkeypatch):
    """One pass (the default): each file read into place is downloaded once, hashed as it is
    placed, with no verifying pass and no local copy. ``verify_first=True``: the first pass
    downloads each file once, verifying it, into a private local copy; the second reads that copy
    into the live arrays (not a second download). The copies go when load_state returns;
    UNIFIED_STORE_LOAD_COPY=0 downloads twice; an object changed on the store after it was
    verified is still refused with nothing restored."""
    from unified.checkpoint import store

    url, fs = bucket
    monkeypatch.setenv("UNIFIED_IN_PLACE_MIN_BYTES", "0")  # every array into place
    acc, model, optimizer = accelerator_of()
    _step(acc, model, optimizer)
    saved = _params(model)
    acc.save_state(f"{url}/run/copy")
    seen = {"store": [], "copy": [], "verify": []}
    from_store, from_folder, verify = store.ObjectStore.read_placed, store.Folder.read_placed, store.ObjectStore.verify

    def store_read(self, path, *args):
        seen["store"].append(path)
        return from_store(self, path, *args)

    def copy_read(self, path, *args):
        seen["copy"].append(path)
        return from_folder(self, path, *args)

    def verifying(self, path, *args, **options):
        seen["verify"].append(path)
        return verify(self, path, *args, **options)

    monkeypatch.setattr(store.ObjectStore, "read_placed", store_read)
    monkeypatch.setattr(store.Folder, "read_placed", copy_read)
    monkeypatch.setattr(store.ObjectStore, "verify", verifying)
    placed = ("model_0.safetensors", "optimizer_0.safetensors")  # (rng_0's arrays are read in one pass, as before)
    _step(acc, model, optimizer)
    acc.load_state(f"{url}/run/copy")
    assert _same(_params(model), saved)
    assert sorted(p.rsplit("/", 1)[1] for p in seen["store"] if p.endswith(placed)) == list(placed), seen
    assert seen["copy"] == [] and not any(p.endswith(placed) for p in seen["verify"]), seen

    for kept in seen.values():
        kept.clear()
    _step(acc, model, optimizer)
    acc.load_state(f"{url}/run/copy", verify_first=True)
    assert _same(_params(model), saved)
    assert not any(p.endswith(placed) for p in seen["store"]) and len(seen["copy"]) == 2, seen
    assert not any(os.path.exists(os.path.dirname(p)) for p in seen["copy"])  # removed with the load

    seen["copy"].clear()
    monkeypatch.setenv("UNIFIED_STORE_LOAD_COPY", "0")
    _step(acc, model, optimizer)
    acc.load_state(f"{url}/run/copy", verify_first=True)
    assert _same(_params(model), saved)
    assert any(p.endswith("model_0.safetensors") for p in seen["store"]) and seen["copy"] == [], seen

    monkeypatch.delenv("UNIFIED_STORE_LOAD_COPY")

    def verify_then_rewrite(self, path, size, checksum, **options):
        identity = verify(self, path, size, checksum, **options)
        if path.endswith("model_0.safetensors"):  # after the first pass: the verified copy is intact
            data = bytearray(fs.cat_file(path))
            data[-1] ^= 1
            fs.pipe_file(path, bytes(data))
        return identity

    monkeypatch.setattr(store.ObjectStore, "verify", verify_then_rewrite)
    _step(acc, model, optimizer)
    moved = _params(model)
    with pytest.raises(CheckpointError, match="changed after it was verified; nothing was restored"):
        acc.load_state(f"{url}/run/copy", verify_first=True)
    assert _same(_params(model), moved)


def test_a_backend_without_sharded_to_store_refuses_sharded_state_on_a_store_and_writes_nothing(
        bucket, accelerator_of, monkeypatch):
    """Both built-in backends write sharded state to a store; a third-party backend that does
    not (no ``sharded_to_store``) must be refused before anything is written, and must not read
    a store's sharded checkpoint either."""
    import torch

    url, fs = bucket
    acc, model, optimizer = accelerator_of()
    # one process holds whole arrays: call the weight sharded (DCP writes plain tensors too)
    monkeypatch.setattr(type(acc._backend), "is_sharded",
                        lambda self, value: torch.is_tensor(value) and value.ndim == 2)
    acc.save_state(f"{url}/sharded")
    assert any(path.rsplit("/", 1)[-1].startswith("sharded.") for path in fs.ls(f"{url}/sharded", detail=False))
    monkeypatch.setattr(type(acc._backend), "sharded_to_store", False)
    with pytest.raises(CheckpointError,
                       match=r"to a folder only in this version; nothing was written.*object-storage-limits"):
        acc.save_state(f"{url}/refused")
    assert not fs.exists(f"{url}/refused")
    with pytest.raises(CheckpointError, match=r"cannot read from a store.*object-storage-limits"):
        acc.load_state(f"{url}/sharded")
    monkeypatch.setattr(type(acc._backend), "sharded_to_store", True)
    acc.load_state(f"{url}/sharded")


def test_an_object_written_again_with_as_many_bytes_counts_as_changed(bucket):
    """A load refuses a file that changed between its verifying pass and the read into place
    (`Location.changed`). Each client names what a write changes its own way: on gs:// the
    identity read S3's names only (``ETag``, ``LastModified``), got neither, and a same-size
    rewrite went unseen."""
    url, fs = bucket
    fs.pipe_file(f"{url}/obj", b"a" * 64)
    store = location_of(url)
    before = store.identity(f"{url}/obj", 64)
    assert not store.changed(f"{url}/obj", before)
    fs.pipe_file(f"{url}/obj", b"b" * 64)
    assert store.changed(f"{url}/obj", before)


def test_a_one_pass_load_asks_the_store_for_each_object_s_metadata_once(accelerator_of, monkeypatch):
    """A one-pass load (the default) asks the real server (moto, behind a counting proxy) for each
    object's metadata (HEAD) once at most: `ObjectStore.describe` compares the size of an object
    read into place with the manifest's before anything is restored; `read_placed` then streams
    it with no request for metadata (neither its own nor the client's, which s3fs makes when it
    opens or first reads an object), its bytes checked by the stream's length and the xxh3 at
    the end. Before, every object read into place was asked three times (describe, read_placed's
    identity, s3fs's file), every other object twice. An object changed, shortened or deleted
    between describe and the read is still refused, naming it."""
    from unified.testing.object_store import FaultyEndpoint, requests_through, s3_server

    monkeypatch.setenv("UNIFIED_IN_PLACE_MIN_BYTES", "0")  # every array into place
    with s3_server() as server, FaultyEndpoint(server.endpoint) as proxy, requests_through(proxy.endpoint):
        url = server.bucket()
        acc, model, optimizer = accelerator_of()
        _step(acc, model, optimizer)
        saved = _params(model)
        acc.save_state(f"{url}/run")
        _step(acc, model, optimizer)
        asked, take = [], proxy._take

        def counted(method, path):
            asked.append((method, path.split("?", 1)[0]))
            return take(method, path)

        monkeypatch.setattr(proxy, "_take", counted)
        acc.load_state(f"{url}/run")
        assert _same(_params(model), saved)
        heads = {}
        for method, path in asked:
            if path.endswith(".safetensors") and method == "HEAD":
                name = path.rsplit("/", 1)[1]
                heads[name] = heads.get(name, 0) + 1
        assert {"model_0.safetensors", "optimizer_0.safetensors"} <= set(heads), asked
        assert set(heads.values()) == {1}, heads

        # changed after describe asked for its metadata, before the read: refused all the same
        describe = ObjectStore.describe
        changes = {"checksum mismatch": lambda data: data[:-1] + bytes([data[-1] ^ 1]),  # as many bytes
                   "ended before its": lambda data: data[:-8],
                   "missing from the store": None}
        fs = server.filesystem()
        kept = fs.cat_file(f"{url}/run/model_0.safetensors")
        for refusal, change in changes.items():
            def describe_then_change(self, path, size, change=change):
                described = describe(self, path, size)
                if path.endswith("model_0.safetensors"):
                    if change is None:
                        fs.rm_file(path)
                    else:
                        fs.pipe_file(path, change(kept))
                return described

            monkeypatch.setattr(ObjectStore, "describe", describe_then_change)
            with pytest.raises(CheckpointError, match=f"model_0.safetensors: .*{refusal}.*found while model"):
                acc.load_state(f"{url}/run")
            monkeypatch.setattr(ObjectStore, "describe", describe)
            fs.pipe_file(f"{url}/run/model_0.safetensors", kept)
        acc.load_state(f"{url}/run")
        assert _same(_params(model), saved)
