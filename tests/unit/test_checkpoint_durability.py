"""A synchronous save_state() returns with its checkpoint durable and retention applied (issue 24,
regression 1; contract part 3): every file and folder of the new checkpoint is fsynced before
the commit's rename, and older checkpoints beyond total_limit are gone when the call returns,
as Accelerate's are. A sync that fails commits nothing and deletes nothing."""
from __future__ import annotations

import os

import pytest

from unified import CheckpointError, ProjectConfiguration
from unified.checkpoint import layout

from .memory_backend import MemoryGroup


def _accelerator(tmp_path, total_limit):
    config = ProjectConfiguration(str(tmp_path / "run"), automatic_checkpoint_naming=True, total_limit=total_limit)
    return MemoryGroup(1).accelerator(0, project_config=config)


def test_retention_is_applied_when_save_state_returns(tmp_path):
    acc = _accelerator(tmp_path, total_limit=2)
    for _ in range(3):
        acc.save_state()
    # no end_training, no wait: the call itself applied the limit
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]


def test_the_checkpoint_is_synced_before_its_commit(tmp_path, monkeypatch):
    acc = _accelerator(tmp_path, total_limit=1)
    events = []
    real_fsync_tree, real_commit = layout.fsync_tree, layout.commit
    monkeypatch.setattr(layout, "fsync_tree",
                        lambda d: (events.append(("sync", os.path.basename(d))), real_fsync_tree(d)))
    monkeypatch.setattr(layout, "commit", lambda tmp, final, token: (events.append(("commit", os.path.basename(final))),
                                                                     real_commit(tmp, final, token)))
    acc.save_state()
    acc.save_state()
    assert [kind for kind, _ in events] == ["sync", "commit", "sync", "commit"]
    assert events[0][1].startswith(".checkpoint_0.tmp-") and events[1][1] == "checkpoint_0"
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["checkpoint_1"]


def test_a_failed_sync_commits_nothing_and_keeps_the_older_checkpoints(tmp_path, monkeypatch):
    acc = _accelerator(tmp_path, total_limit=1)
    acc.save_state()

    def broken(directory):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(layout, "fsync_tree", broken)
    with pytest.raises(CheckpointError, match="checkpoint_1"):
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["checkpoint_0"]  # no temporary left either


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
