"""Checkpoints in a folder (issue 46): a retention delete takes the checkpoint out of the listing
before it deletes its files and reports a failure; automatic naming never writes over a
committed checkpoint, even when its listing missed it; the first save makes the folders it
created durable (each one, and the parent of the topmost).

Before, retention deleted with ``shutil.rmtree`` in whatever order the folder listed its files
(a failure half-way left a manifest whose files were gone: listed, loaded, refused); a listing
that missed ``checkpoint_N`` made the next save replace it; and the folders a first save created
(``project_dir``, ``project_dir/checkpoints``) were never fsynced into their parents, so a power
loss after the save returned could lose the whole tree."""
from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")

from unified import Accelerator, CheckpointError, ProjectConfiguration  # noqa: E402
from unified.checkpoint import layout  # noqa: E402


def _accelerator(project, **config):
    acc = Accelerator(backend="torch", project_config=ProjectConfiguration(
        str(project), automatic_checkpoint_naming=True, **config))
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(4, 3))
    return acc, model


def test_retention_takes_the_checkpoint_out_of_the_listing_first_and_reports_a_failed_delete(tmp_path, monkeypatch):
    acc, model = _accelerator(tmp_path, total_limit=1)
    try:
        acc.save_state()
        rmtree = shutil.rmtree

        def fails_half_way(path, *args, **kwargs):  # an I/O error after the first file went
            if kwargs.get("ignore_errors"):
                return rmtree(path, *args, **kwargs)
            os.remove(os.path.join(path, "model_0.safetensors"))
            raise OSError(5, "Input/output error", path)

        monkeypatch.setattr(shutil, "rmtree", fails_half_way)
        with pytest.raises(CheckpointError, match="committed the checkpoint, but removing older ones") as caught:
            acc.save_state()
        monkeypatch.undo()
        assert "Input/output error" in str(caught.value)
        checkpoints = str(tmp_path / "checkpoints")
        # the half-deleted checkpoint is never listed (nor loaded): its files are not all there
        assert [n for n, _ in layout.numbered_checkpoints(checkpoints)] == [1]
        assert acc.load_state() == os.path.join(checkpoints, "checkpoint_1")
        acc.save_state()  # the next save deletes what the failed delete left
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_2"]
    finally:
        acc.end_training()


def test_apply_retention_reports_a_failed_delete(tmp_path, monkeypatch):
    for n in range(3):
        (tmp_path / f"checkpoint_{n}").mkdir()
        (tmp_path / f"checkpoint_{n}" / "manifest.json").write_text("{}")

    def refuses(path, *args, **kwargs):
        if kwargs.get("ignore_errors"):
            return
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shutil, "rmtree", refuses)
    with pytest.raises(OSError, match="Permission denied"):
        layout.apply_retention(str(tmp_path), 1, keep=str(tmp_path / "checkpoint_2"))
    assert [n for n, _ in layout.numbered_checkpoints(str(tmp_path))] == [1, 2]


def test_automatic_naming_never_replaces_a_committed_checkpoint_its_listing_missed(tmp_path, monkeypatch):
    first, _ = _accelerator(tmp_path)
    saved = first.save_state()
    first.end_training()
    manifest = json.loads((tmp_path / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    monkeypatch.setattr(layout, "highest_number", lambda folder: None)  # a listing that missed checkpoint_0
    acc, _ = _accelerator(tmp_path)
    try:
        assert acc.save_state() == str(tmp_path / "checkpoints" / "checkpoint_1")
    finally:
        acc.end_training()
    assert saved == str(tmp_path / "checkpoints" / "checkpoint_0")
    assert json.loads((tmp_path / "checkpoints" / "checkpoint_0" / "manifest.json").read_text()) == manifest


def _recording_fsyncs(monkeypatch):
    synced = []
    real = layout._fsync_dir

    def record(path):
        synced.append(os.path.abspath(path))
        real(path)

    monkeypatch.setattr(layout, "_fsync_dir", record)
    return synced


def test_the_first_automatic_save_fsyncs_the_folders_it_created_and_their_parent(tmp_path, monkeypatch):
    synced = _recording_fsyncs(monkeypatch)
    project = tmp_path / "new" / "project"
    acc, _ = _accelerator(project)
    try:
        acc.save_state()
    finally:
        acc.end_training()
    for folder in (project / "checkpoints", project, tmp_path / "new", tmp_path):
        assert str(folder) in synced, (folder, synced)


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "save_hook"])
def test_a_save_to_a_new_folder_fsyncs_the_folders_it_created_and_their_parent(tmp_path, monkeypatch, hooked):
    synced = _recording_fsyncs(monkeypatch)
    acc = Accelerator(backend="torch")
    try:
        acc.prepare(torch.nn.Linear(2, 2))
        if hooked:  # Accelerate's save hook runs first, into the checkpoint's folder
            acc.register_save_state_pre_hook(lambda models, weights, output_dir: None)
        acc.save_state(str(tmp_path / "a" / "b" / "last"))
    finally:
        acc.end_training()
    for folder in (tmp_path / "a" / "b", tmp_path / "a", tmp_path):
        assert str(folder) in synced, (folder, synced)


def test_make_dirs_fsyncs_only_what_it_created(tmp_path, monkeypatch):
    synced = _recording_fsyncs(monkeypatch)
    (tmp_path / "there").mkdir()
    assert layout.make_dirs(str(tmp_path / "there" / "x" / "y")) == [str(tmp_path / "there" / "x"),
                                                                      str(tmp_path / "there" / "x" / "y")]
    assert sorted(synced) == sorted([str(tmp_path / "there" / "x" / "y"), str(tmp_path / "there" / "x"),
                                     str(tmp_path / "there")])
    synced.clear()
    assert layout.make_dirs(str(tmp_path / "there" / "x")) == [] and synced == []
