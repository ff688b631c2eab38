"""Durability before retention (issue 11, finding 10): older checkpoints are deleted only after every
file and folder of the new one was fsynced, so a power loss cannot leave only a torn newest one."""
from __future__ import annotations

import os
import threading

from unified import ProjectConfiguration
from unified.checkpoint import layout

from .memory_backend import MemoryGroup


def test_retention_waits_until_the_new_checkpoint_is_synced(tmp_path, monkeypatch):
    synced, release = [], threading.Event()
    real_fsync_tree = layout.fsync_tree

    def slow_fsync_tree(directory):
        release.wait(30)
        real_fsync_tree(directory)
        synced.append(os.path.basename(directory))

    monkeypatch.setattr(layout, "fsync_tree", slow_fsync_tree)
    release.set()
    config = ProjectConfiguration(str(tmp_path / "run"), automatic_checkpoint_naming=True, total_limit=1)
    acc = MemoryGroup(1).accelerator(0, project_config=config)
    acc.save_state()
    acc._checkpoints.wait_until_durable()
    release.clear()  # the next sync is slow: checkpoint_1 is committed but not yet on disk
    acc.save_state()
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(folder)) == ["checkpoint_0", "checkpoint_1"]  # the durable one stays
    release.set()
    acc.end_training()  # waits for the sync, then retention
    assert sorted(os.listdir(folder)) == ["checkpoint_1"]
    assert synced == ["checkpoint_0", "checkpoint_1"]


def test_fsync_tree_flushes_every_file_and_folder(tmp_path, monkeypatch):
    (tmp_path / "ckpt" / "sharded" / "d").mkdir(parents=True)
    for name in ("ckpt/a", "ckpt/manifest.json", "ckpt/sharded/d/x"):
        (tmp_path / name).write_bytes(b"1")
    flushed = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    layout.fsync_tree(str(tmp_path / "ckpt"))
    names = [os.path.relpath(p, tmp_path) for p in flushed]
    assert sorted(names[:3]) == ["ckpt/a", "ckpt/manifest.json", "ckpt/sharded/d/x"]  # files first
    assert names[3:] == ["ckpt/sharded/d", "ckpt/sharded", "ckpt", "."]  # then folders, deepest first, and the parent
