"""The hashing DCP storage of the torch backend (`backends/torch/storage.py`), in one process:
its files are what torch's own safetensors storage reads (and it reads torch's), the checksums
it reports are those of the bytes on disk, computed in the pass that wrote or read them, and a
damaged file reports another checksum instead of raising (the manager compares and refuses)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
if not hasattr(dcp, "HuggingFaceStorageWriter"):
    pytest.skip("this torch has no safetensors storage for DCP", allow_module_level=True)

from backends.torch.storage import HashingReader, HashingWriter  # noqa: E402
from unified.checkpoint import safetensors_io  # noqa: E402


def _state():
    generator = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(6, 5, generator=generator),
        "layer.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
        "step": torch.arange(3, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }


def _fresh(state):
    return {k: torch.full_like(v, 7) for k, v in state.items()}


def _only_file(directory):
    (name,) = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    return name


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def test_written_files_hash_as_reported_and_torch_reads_them(tmp_path):
    state = _state()
    writer = HashingWriter(str(tmp_path))
    dcp.save(state, storage_writer=writer)
    name = _only_file(tmp_path)
    assert writer.written == {name: safetensors_io.verify_file(str(tmp_path / name), None, None)}
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".metadata")]  # no pickle
    theirs = _fresh(state)
    dcp.load(theirs, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)))
    assert _equal(theirs, state)


@pytest.mark.parametrize("writer_kind", ["ours", "torch"])
def test_a_file_needed_whole_is_read_and_hashed_in_one_pass(tmp_path, writer_kind):
    state = _state()
    writer = HashingWriter(str(tmp_path)) if writer_kind == "ours" else \
        dcp.HuggingFaceStorageWriter(str(tmp_path), save_distributed=True)
    dcp.save(state, storage_writer=writer)
    name = _only_file(tmp_path)
    ours = _fresh(state)
    reader = HashingReader(str(tmp_path))
    dcp.load(ours, storage_reader=reader)
    assert _equal(ours, state)
    assert reader.hashed == {name: safetensors_io.verify_file(str(tmp_path / name), None, None)}


def test_a_damaged_file_reports_another_checksum(tmp_path):
    state = _state()
    writer = HashingWriter(str(tmp_path))
    dcp.save(state, storage_writer=writer)
    name = _only_file(tmp_path)
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    reader = HashingReader(str(tmp_path))
    dcp.load(_fresh(state), storage_reader=reader)
    assert reader.hashed[name]["size"] == writer.written[name]["size"]
    assert reader.hashed[name]["xxh3"] != writer.written[name]["xxh3"]
