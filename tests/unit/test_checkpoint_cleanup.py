"""Cleanup after a save touches only what saves create (issue 11, finding 9).

A save leaves ``.{name}.tmp-{token}`` / ``.{name}.old-{token}`` beside its checkpoint; cleanup
must match those names whole (12 hex digits of token, the name of a checkpoint of that folder)
and never take an unrelated hidden entry such as ``.npm.tmp-cache`` for one of them.
"""
from __future__ import annotations

import os
from typing import Any, Dict

from unified.checkpoint import layout
from unified.checkpoint.manifest import write_manifest

from .memory_backend import MemoryGroup


def _body(files: Dict[str, Any]) -> Dict[str, Any]:
    return {"backend": "memory", "num_processes": 1, "iteration": 0, "objects": [], "structures": {},
            "sharded": {}, "files": files}


def _checkpoint_dir(path) -> None:
    path.mkdir()
    write_manifest(str(path), _body({}))


def test_cleanup_removes_only_our_own_temporaries(tmp_path):
    _checkpoint_dir(tmp_path / "ckpt")
    token = "0123456789ab"
    ours = [f".ckpt.tmp-{token}", f".ckpt.old-{token}"]
    lookalikes = [".npm.tmp-cache", ".config.old-2024", ".ckpt.tmp-cache", ".ckpt.old-0123456789AB",
                  ".ckpt.tmp-0123456789abc", ".other.tmp-0123456789ab", ".ckpt.tmp-0123456789ab.bak",
                  "ckpt.tmp-0123456789ab"]
    (tmp_path / "config").mkdir()
    for name in ours + lookalikes:
        (tmp_path / name).mkdir()
    (tmp_path / ".notes.tmp-0123456789ab").write_text("a file, not a directory we made")
    layout.remove_stale_temporaries(str(tmp_path))
    left = set(os.listdir(tmp_path))
    assert not left & set(ours)
    assert set(lookalikes) | {".notes.tmp-0123456789ab", "ckpt", "config"} <= left


def test_cleanup_removes_temporaries_of_automatic_checkpoints(tmp_path):
    _checkpoint_dir(tmp_path / "checkpoint_3")
    (tmp_path / ".checkpoint_4.tmp-00000000abcd").mkdir()  # a crashed save of the next one
    layout.remove_stale_temporaries(str(tmp_path))
    assert os.listdir(tmp_path) == ["checkpoint_3"]


def test_recover_restores_only_an_exact_set_aside_name(tmp_path):
    for name in (".ckpt.old-backup", ".ckpt.old-0123456789ab"):
        _checkpoint_dir(tmp_path / name)
    layout.recover(str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path)) == [".ckpt.old-backup", "ckpt"]


def test_save_state_leaves_unrelated_hidden_entries_alone(tmp_path):
    for name in (".npm.tmp-cache", ".config.old-2024", "config"):
        (tmp_path / name).mkdir()
    accelerator = MemoryGroup(1).accelerator(0)
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path)) == [".config.old-2024", ".npm.tmp-cache", "ckpt", "config"]
