"""A damaged newest checkpoint never stops a job (issue 46).

``load_state()`` without a path and ``load_state(if_exists=True)`` with automatic naming go on to
the newest checkpoint that verifies; the damaged ones are set aside (``checkpoint_N.damaged``),
which listing, loading, numbering and retention skip, and never deleted; the main process says
which it skipped and why. Only damage falls back: an error that is not about damage (the
checkpoint does not fit the model, a store out of reach) raises as before, and so does an
explicit ``load_state(path)`` of a damaged checkpoint.

Before, ``load_state()`` and ``load_state(if_exists=True)`` always took the highest
``checkpoint_N``: one flipped byte in it failed every restart, and a script that started over
and saved twice with ``total_limit=3`` deleted both intact checkpoints and kept the damaged one.
"""
from __future__ import annotations

import json
import os
import struct
import warnings

import pytest

torch = pytest.importorskip("torch")

from unified import Accelerator, CheckpointError, ProjectConfiguration  # noqa: E402
from unified.checkpoint import layout  # noqa: E402
from unified.checkpoint.store import Folder  # noqa: E402
from unified.errors import see  # noqa: E402

from .helpers import params_of, same_params, train_step  # noqa: E402


def _accelerator(project, width=4, **config):
    acc = Accelerator(backend="torch", project_config=ProjectConfiguration(
        str(project), automatic_checkpoint_naming=True, **config))
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(width, 3))
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model, optimizer








def _saved_three(project, **config):
    """checkpoint_0, _1, _2 of one run; the parameters each holds."""
    acc, model, optimizer = _accelerator(project, **config)
    held = []
    for _ in range(3):
        train_step(acc, model, optimizer)
        acc.save_state()
        held.append(params_of(model))
    acc.end_training()
    return held


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(checkpoint):
    manifest = checkpoint / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["iteration"] = 99  # without re-signing it: the manifest's own checksum no longer matches
    manifest.write_text(json.dumps(doc))


def _hostile_header(checkpoint):
    path = checkpoint / "model_0.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 60)  # a header "longer" than any file: same size, so read
    path.write_bytes(bytes(data))


# damage -> what the skipped checkpoint's reason says
DAMAGE = {
    "flipped_byte": (lambda c: _flip(c / "model_0.safetensors"), "checksum mismatch"),
    "flipped_rng": (lambda c: _flip(c / "rng_0.safetensors"), "checksum mismatch"),
    "truncated": (lambda c: (c / "optimizer_0.safetensors").write_bytes(
                      (c / "optimizer_0.safetensors").read_bytes()[:-7]),
                  "truncated"),
    "missing_file": (lambda c: (c / "model_0.safetensors").unlink(), "cannot open"),
    "unparseable_manifest": (lambda c: (c / "manifest.json").write_bytes(b'{"format": "unified-chec'), "manifest"),
    "edited_manifest": (_edit_manifest, "modified"),
    "hostile_header": (_hostile_header, "model_0.safetensors"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_load_state_skips_a_damaged_newest_checkpoint_sets_it_aside_and_says_why(tmp_path, damage):
    held = _saved_three(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    harm, reason = DAMAGE[damage]
    harm(checkpoints / "checkpoint_2")
    acc, model, _ = _accelerator(tmp_path)
    try:
        with pytest.warns(UserWarning) as said:
            assert acc.load_state() == str(checkpoints / "checkpoint_1")
        assert same_params(params_of(model), held[1])
        message = " ".join(str(w.message) for w in said)
        assert str(checkpoints / "checkpoint_2") in message and "checkpoint_2.damaged" in message, message
        assert reason in message, message
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1", "checkpoint_2.damaged"]
        # the damaged number is never used again: the next save goes past it
        assert acc.project_configuration.iteration == 3
        assert acc.save_state() == str(checkpoints / "checkpoint_3")
    finally:
        acc.end_training()


def test_if_exists_falls_back_and_retention_keeps_the_intact_checkpoints(tmp_path):
    """The audit's script: start over on a damaged newest checkpoint, save twice with total_limit=3."""
    held = _saved_three(tmp_path, total_limit=3)
    checkpoints = tmp_path / "checkpoints"
    _flip(checkpoints / "checkpoint_2" / "model_0.safetensors")
    acc, model, optimizer = _accelerator(tmp_path, total_limit=3)
    try:
        with pytest.warns(UserWarning, match="checkpoint_2"):
            assert acc.load_state(if_exists=True) == str(checkpoints / "checkpoint_1")
        assert same_params(params_of(model), held[1])
        for _ in range(2):
            train_step(acc, model, optimizer)
            acc.save_state()
        # the damaged one is kept aside (never counted, never deleted), the intact ones are the newest 3
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_2.damaged", "checkpoint_3",
                                                   "checkpoint_4"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing is skipped any more: no warning
            assert acc.load_state() == str(checkpoints / "checkpoint_4")
    finally:
        acc.end_training()


def test_when_no_checkpoint_verifies_load_state_raises_naming_each_and_if_exists_does_not_start_fresh(tmp_path):
    _saved_three(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    for n in range(3):
        _flip(checkpoints / f"checkpoint_{n}" / "model_0.safetensors")
    acc, model, _ = _accelerator(tmp_path)
    before = params_of(model)
    try:
        with pytest.warns(UserWarning), pytest.raises(CheckpointError) as caught:
            acc.load_state(if_exists=True)
        message = str(caught.value)
        for n in range(3):
            assert str(checkpoints / f"checkpoint_{n}") in message, message
        assert "if_exists" in message and "#no-checkpoint-verifies" in message, message
        assert same_params(params_of(model), before)
        assert sorted(os.listdir(checkpoints)) == [f"checkpoint_{n}.damaged" for n in range(3)]
        # a restart (unified launch --max-restarts) must not start fresh over them either
        for call in (lambda: acc.load_state(if_exists=True), acc.load_state):
            with pytest.raises(CheckpointError, match="checkpoint_0.damaged") as again:
                call()
            assert "#no-checkpoint-verifies" in str(again.value)
        assert acc.project_configuration.iteration == 0
        assert acc.save_state() == str(checkpoints / "checkpoint_3")  # never onto a damaged one's number
    finally:
        acc.end_training()


def test_an_error_that_is_not_damage_raises_and_sets_nothing_aside(tmp_path, monkeypatch):
    _saved_three(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    other, _, _ = _accelerator(tmp_path, width=5)  # another model: the checkpoint does not fit it
    try:
        with pytest.raises(CheckpointError, match="checkpoint_2.*#tensor-mismatch"):
            other.load_state()
        with pytest.raises(CheckpointError, match="checkpoint_2.*#tensor-mismatch"):
            other.load_state(if_exists=True)
    finally:
        other.end_training()
    read = Folder.read

    def unreachable(self, path, size, checksum):
        if "checkpoint_2" in path:
            raise CheckpointError(f"{path}: reading failed after the storage client's retries (ConnectTimeout)."
                                  + see("object-storage-unreachable"))
        return read(self, path, size, checksum)

    monkeypatch.setattr(Folder, "read", unreachable)
    acc, _, _ = _accelerator(tmp_path)
    try:
        with pytest.raises(CheckpointError, match="checkpoint_2.*#object-storage-unreachable"):
            acc.load_state()
    finally:
        acc.end_training()
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]


def test_a_damaged_checkpoint_named_explicitly_raises_and_stays_where_it_is(tmp_path):
    _saved_three(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    _flip(checkpoints / "checkpoint_2" / "model_0.safetensors")
    acc, model, _ = _accelerator(tmp_path)
    before = params_of(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for call in (lambda: acc.load_state(str(checkpoints / "checkpoint_2")),
                         lambda: acc.load_state(str(checkpoints / "checkpoint_2"), if_exists=True)):
                with pytest.raises(CheckpointError, match="checksum mismatch"):
                    call()
        assert same_params(params_of(model), before)
        assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    finally:
        acc.end_training()


def test_set_aside_checkpoints_are_skipped_by_listing_numbering_retention_and_cleanup(tmp_path):
    for name in ("checkpoint_1", "checkpoint_2", "checkpoint_7.damaged", "checkpoint_7.damaged-2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    assert [n for n, _ in layout.numbered_checkpoints(str(tmp_path))] == [1, 2]
    assert layout.highest_number(str(tmp_path)) == 7  # never reused
    assert [os.path.basename(p) for _, p in layout.damaged_checkpoints(str(tmp_path))] == [
        "checkpoint_7.damaged", "checkpoint_7.damaged-2"]
    layout.remove_stale_temporaries(str(tmp_path))
    layout.apply_retention(str(tmp_path), 1, keep=str(tmp_path / "checkpoint_2"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_2", "checkpoint_7.damaged", "checkpoint_7.damaged-2"]
    # a second damaged checkpoint of the same number gets its own name, the first is kept
    (tmp_path / "checkpoint_7").mkdir()
    assert os.path.basename(layout.set_aside_damaged(str(tmp_path / "checkpoint_7"))) == "checkpoint_7.damaged-3"
