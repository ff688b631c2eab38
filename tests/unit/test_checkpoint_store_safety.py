"""Checkpoints on an object store (issue 46), on the loopback S3 server (moto) and GCS emulator:

- a damaged newest checkpoint is set aside (its manifest moved to ``manifest.json.damaged``:
  never listed, loaded, counted or deleted) and ``load_state()`` goes on to the next newest;
- a retention delete removes the manifest (the commit) first and a failed delete is reported,
  not swallowed;
- automatic naming never writes over a committed checkpoint, even when the listing missed it;
- without a lease on the prefix (``gs://``), a ``checkpoint_N`` without a manifest may be
  another live run's save in progress: it is left alone.

Before, the damaged newest checkpoint failed every restart; ``ObjectStore.discard`` swallowed a
failed retention delete (and deleted in the store's listing order, the manifest anywhere in it);
a stale listing made the next save write its files and manifest over ``checkpoint_N``; and every
save deleted the manifest-less ``checkpoint_N`` prefixes below its own, a second run's too."""
from __future__ import annotations

import pytest

from unified.checkpoint import lease
from unified.checkpoint.store import ObjectStore
from unified.errors import CheckpointError
from unified.testing.object_store import missing_store_packages

from .helpers import params_of, same_params, train_step

pytestmark = pytest.mark.skipif(missing_store_packages() is not None, reason=str(missing_store_packages()))
torch = pytest.importorskip("torch")






@pytest.fixture
def run_at():
    """``make(project, **config)``: a one-process torch Accelerator with automatic naming at
    ``project`` and a model and an optimizer prepared (ended after the test)."""
    from unified import Accelerator, ProjectConfiguration

    made = []

    def make(project, **config):
        acc = Accelerator(backend="torch", project_config=ProjectConfiguration(
            project, automatic_checkpoint_naming=True, **config))
        torch.manual_seed(0)
        model = acc.prepare(torch.nn.Linear(4, 3))
        optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        made.append(acc)
        return acc, model, optimizer

    yield make
    for acc in made:
        acc.end_training()








def _names(fs, url):
    fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(url, refresh=True))


def _flip(fs, key):
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0xFF  # in the arrays' data: a checksum mismatch
    fs.pipe_file(key, bytes(data))


def test_a_damaged_newest_checkpoint_on_a_store_is_set_aside_and_never_deleted(bucket, run_at):
    url, fs = bucket
    project, checkpoints = f"{url}/run", f"{url}/run/checkpoints"
    acc, model, optimizer = run_at(project, total_limit=2)
    held = []
    for _ in range(3):
        train_step(acc, model, optimizer)
        acc.save_state()
        held.append(params_of(model))
    acc.end_training()
    _flip(fs, f"{checkpoints}/checkpoint_2/model_0.safetensors")

    later, model2, optimizer2 = run_at(project, total_limit=2)
    with pytest.warns(UserWarning) as said:
        assert later.load_state(if_exists=True) == f"{checkpoints}/checkpoint_1"
    message = " ".join(str(w.message) for w in said)
    assert "checkpoint_2" in message and "checksum mismatch" in message and "manifest.json.damaged" in message
    assert same_params(params_of(model2), held[1])
    assert not fs.exists(f"{checkpoints}/checkpoint_2/manifest.json")
    assert fs.exists(f"{checkpoints}/checkpoint_2/manifest.json.damaged")
    for _ in range(2):  # numbered past it; neither the leftover cleanup nor retention deletes it
        train_step(later, model2, optimizer2)
        later.save_state()
    assert _names(fs, checkpoints) == ["checkpoint_2", "checkpoint_3", "checkpoint_4"]
    assert fs.exists(f"{checkpoints}/checkpoint_2/manifest.json.damaged")
    assert fs.exists(f"{checkpoints}/checkpoint_2/model_0.safetensors")


def test_when_every_checkpoint_on_a_store_is_damaged_a_restart_does_not_start_fresh(bucket, run_at):
    url, fs = bucket
    project, checkpoints = f"{url}/run", f"{url}/run/checkpoints"
    acc, model, optimizer = run_at(project)
    acc.save_state()
    acc.end_training()
    _flip(fs, f"{checkpoints}/checkpoint_0/optimizer_0.safetensors")
    later, _, _ = run_at(project)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="no-checkpoint-verifies"):
        later.load_state(if_exists=True)
    with pytest.raises(CheckpointError, match="checkpoint_0.*no-checkpoint-verifies"):
        later.load_state(if_exists=True)


def _failing_deletes(fs, monkeypatch, calls):
    """Record every delete on ``fs``; fail those of anything but a manifest."""
    for method in ("rm", "rm_file"):
        real = getattr(fs, method)

        def delete(path, *args, _real=real, _method=method, **kwargs):
            paths = path if isinstance(path, list) else [path]
            calls.append((_method, paths))
            if not all(str(p).endswith("/manifest.json") for p in paths):
                raise OSError(5, "the store refused the delete")
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(fs, method, delete)


def test_retention_on_a_store_deletes_the_manifest_first_and_reports_a_failed_delete(bucket, run_at, monkeypatch):
    url, fs = bucket
    project, checkpoints = f"{url}/run", f"{url}/run/checkpoints"
    acc, model, optimizer = run_at(project, total_limit=1)
    acc.save_state()
    store_fs = ObjectStore(project).fs  # the client the manager uses (fsspec keeps one per options)
    calls = []
    _failing_deletes(store_fs, monkeypatch, calls)
    train_step(acc, model, optimizer)
    with pytest.raises(CheckpointError, match="committed the checkpoint, but removing older ones") as caught:
        acc.save_state()
    monkeypatch.undo()
    assert "checkpoint_0" in str(caught.value)
    touched = [paths for _, paths in calls if any("checkpoint_0" in str(p) for p in paths)]
    assert touched and all(str(p).endswith("checkpoint_0/manifest.json") for p in touched[0]), calls
    assert not fs.exists(f"{checkpoints}/checkpoint_0/manifest.json")  # never listed nor loaded again
    assert fs.exists(f"{checkpoints}/checkpoint_0/model_0.safetensors")  # what the failed delete left
    assert acc.load_state() == f"{checkpoints}/checkpoint_1"


def test_automatic_naming_on_a_store_never_writes_over_a_committed_checkpoint(bucket, run_at, monkeypatch):
    url, fs = bucket
    project, checkpoints = f"{url}/run", f"{url}/run/checkpoints"
    first, _, _ = run_at(project)
    first.save_state()
    first.end_training()
    manifest = fs.cat_file(f"{checkpoints}/checkpoint_0/manifest.json")
    monkeypatch.setattr(ObjectStore, "_names", lambda self, folder: [])  # a stale listing: nothing there yet
    acc, _, _ = run_at(project)
    assert acc.save_state() == f"{checkpoints}/checkpoint_1"
    monkeypatch.undo()
    assert fs.cat_file(f"{checkpoints}/checkpoint_0/manifest.json") == manifest


@pytest.mark.parametrize("held", [True, False], ids=["lease", "no_lease"])
def test_leftovers_below_a_new_checkpoint_are_deleted_only_under_a_lease(bucket, run_at, monkeypatch, held):
    url, fs = bucket
    project, checkpoints = f"{url}/run", f"{url}/run/checkpoints"
    if url.startswith("gs://") and held:
        pytest.skip("no lease on gs:// in this version (lease.supported)")
    if not held:
        monkeypatch.setattr(lease, "supported", lambda fs: False)
    acc, _, _ = run_at(project)
    acc.save_state()
    # another run's save in progress (or a crashed one's): files under checkpoint_1, no manifest yet
    fs.pipe_file(f"{checkpoints}/checkpoint_1/model_0.safetensors", b"not yet committed")
    assert acc.save_state() == f"{checkpoints}/checkpoint_2"
    assert fs.exists(f"{checkpoints}/checkpoint_1/model_0.safetensors") is (not held)
