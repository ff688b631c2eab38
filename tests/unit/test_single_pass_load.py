"""A load reads every byte once (issue 48): the large arrays are hashed as they are read into the
live tensors, with no verifying pass before. A mismatch found while placing raises
`CheckpointError` naming the file and the object; the objects then hold part of the checkpoint,
and a later load restores them whole; with automatic naming the load goes on to the next newest
checkpoint by itself. ``load_state(verify_first=True)`` keeps the old order (verify everything,
then restore), which reads the large files twice and changes nothing when it fails.

Before, every load verified the large files whole first and read them again into place: twice
the bytes of every resume (this file's first test fails there: 2.0x the checkpoint's bytes)."""
from __future__ import annotations

import os
import shutil
import warnings

import pytest

from unified.errors import CheckpointError

from .changed_files import flip_a_byte

torch = pytest.importorskip("torch")


def _run(project=None):
    from unified import Accelerator, ProjectConfiguration

    config = None if project is None else ProjectConfiguration(str(project), automatic_checkpoint_naming=True)
    acc = Accelerator(backend="torch", project_config=config)
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 8)))  # 8 MiB
    optimizer = acc.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
    return acc, model, optimizer


def _step(acc, model, optimizer):
    acc.backward(model(torch.ones(2, 1024)).sum())
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(model, optimizer):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {(p, n): t.clone() for p, s in optimizer.state_dict()["state"].items() for n, t in s.items()})


def _same(a, b):
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def _bytes_read() -> int:
    """What this process has read with read(2) and its kin (pread, preadv) so far."""
    with open("/proc/self/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))


def _checkpoint_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))


def test_a_load_reads_each_byte_of_the_checkpoint_once_and_verify_first_reads_the_large_files_twice(tmp_path):
    acc, model, optimizer = _run()
    _step(acc, model, optimizer)  # the moments exist: the model's and the optimizer's files are read into place
    saved = _snapshot(model, optimizer)
    folder = acc.save_state(str(tmp_path / "ckpt"))
    total = _checkpoint_bytes(folder)
    _step(acc, model, optimizer)
    before = _bytes_read()
    acc.load_state(folder)
    once = _bytes_read() - before
    assert _same(_snapshot(model, optimizer), saved)
    assert total <= once < 1.1 * total, (once, total)

    _step(acc, model, optimizer)
    before = _bytes_read()
    acc.load_state(folder, verify_first=True)
    twice = _bytes_read() - before
    assert _same(_snapshot(model, optimizer), saved)
    assert twice > 1.8 * total, (twice, total)
    acc.end_training()


def test_damage_found_while_placing_names_the_file_and_the_object_and_a_later_load_restores_whole(tmp_path):
    acc, model, optimizer = _run()
    _step(acc, model, optimizer)
    saved = _snapshot(model, optimizer)
    intact = acc.save_state(str(tmp_path / "intact"))
    damaged = str(tmp_path / "damaged")
    shutil.copytree(intact, damaged)
    flip_a_byte(os.path.join(damaged, "model_0.safetensors"))  # in the middle of the data: the header is intact
    _step(acc, model, optimizer)
    moved = _snapshot(model, optimizer)

    with pytest.raises(CheckpointError) as caught:
        acc.load_state(damaged)
    message = str(caught.value)
    assert "model_0.safetensors: checksum mismatch" in message, message
    assert "found while model_0 was read into place" in message and "#damaged-while-placed" in message, message
    assert not _same(_snapshot(model, optimizer), moved)  # part of the checkpoint is in place (documented)

    acc.load_state(intact)
    assert _same(_snapshot(model, optimizer), saved)

    _step(acc, model, optimizer)
    moved = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match="model_0.safetensors: checksum mismatch"):
        acc.load_state(damaged, verify_first=True)
    assert _same(_snapshot(model, optimizer), moved)  # verified first: nothing restored
    acc.end_training()


def test_automatic_naming_goes_on_past_a_checkpoint_found_damaged_while_placing(tmp_path):
    acc, model, optimizer = _run(tmp_path / "project")
    _step(acc, model, optimizer)
    acc.save_state()
    older = _snapshot(model, optimizer)
    _step(acc, model, optimizer)
    newest = acc.save_state()
    flip_a_byte(os.path.join(newest, "model_0.safetensors"))
    _step(acc, model, optimizer)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loaded = acc.load_state()
    assert os.path.basename(loaded) == "checkpoint_0"
    assert _same(_snapshot(model, optimizer), older)  # restored whole from the older checkpoint
    assert sorted(os.listdir(os.path.dirname(newest))) == ["checkpoint_0", "checkpoint_1.damaged"]
    warned = [str(w.message) for w in said if "damaged" in str(w.message)]
    assert len(warned) == 1 and "model_0.safetensors: checksum mismatch" in warned[0], warned
    acc.end_training()


def test_a_damaged_header_that_names_another_shape_is_damage_not_a_model_mismatch(tmp_path):
    """Only the header is read before the objects are checked: a flipped shape there must read
    as the damage it is (a checksum mismatch, which automatic naming skips), not as a checkpoint
    of another model."""
    acc, model, optimizer = _run()
    folder = acc.save_state(str(tmp_path / "ckpt"))
    path = os.path.join(folder, "model_0.safetensors")
    with open(path, "rb") as handle:
        data = handle.read()
    assert data.count(b"[2048,1024]") == 1
    with open(path, "r+b") as handle:
        handle.write(data.replace(b"[2048,1024]", b"[1024,2048]"))
    moved = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError) as caught:
        acc.load_state(folder)
    assert "model_0.safetensors: checksum mismatch" in str(caught.value), str(caught.value)
    assert _same(_snapshot(model, optimizer), moved)  # refused before anything was placed
    acc.end_training()
