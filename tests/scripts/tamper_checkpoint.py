"""Change a checkpoint's files while `load_state` reads them, and after it returned (issue 11,
finding 4). Run as ``python tests/scripts/tamper_checkpoint.py BACKEND``: for every case it
prints one ``CASE <json>`` line; a crash (SIGBUS from a mapped file that shrank) ends the
process instead, which the calling test reports.

Cases (each on a fresh checkpoint of the conformance suite's tiny training):

- ``rewrite-after-verify`` / ``truncate-after-verify``: every data file is overwritten in place
  (same size, other bytes) or truncated to 0 bytes after `load_state` verified the files and
  before it restores anything. Must: restore exactly the saved state, or raise `CheckpointError`
  with every object as it was.
- ``rewrite-during-read`` / ``truncate-during-read``: the same happens while a file is being
  read, right after its first bytes were hashed. Same rule.
- ``rewrite-after-load`` / ``truncate-after-load``: the files change after `load_state`
  returned. Must: the live state is unchanged (no restored array shares memory with a file).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT]

from unified import Accelerator, CheckpointError  # noqa: E402
from unified.checkpoint import manager as manager_module  # noqa: E402
from unified.checkpoint import safetensors_io, safetensors_read  # noqa: E402
from unified.testing.kit import make_training  # noqa: E402


def fingerprint(acc) -> str:
    """A hash of every byte `save_state` would write now (all objects and RNG states)."""
    snap = acc._checkpoints.snapshot(0)
    digest = hashlib.sha256(json.dumps(snap.structures, sort_keys=True, default=str).encode())
    for name in sorted(snap.files):
        for key, (dtype, shape, raw) in sorted(snap.files[name].items()):
            digest.update(f"{name}/{key}/{dtype}/{shape}".encode())
            digest.update(bytes(raw))
    return digest.hexdigest()


def data_files(directory: str) -> list:
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def tamper(path: str, how: str) -> None:
    if how == "truncate":
        os.truncate(path, 0)
        return
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:  # in place: same inode, the page cache changes
        handle.seek(size // 2)
        flipped = bytes(255 - b for b in handle.read())
        handle.seek(size // 2)
        handle.write(flipped)


def run_case(backend: str, case: str, base: str) -> dict:
    acc = Accelerator(backend=backend, seed=3)
    run = make_training(acc)
    run.step()
    directory = os.path.join(base, case)
    acc.save_state(directory)
    saved = fingerprint(acc)
    run.step()
    before_load = fingerprint(acc)
    how, when = case.split("-", 1)
    restore_read, restore_hash = manager_module.CheckpointManager._read, safetensors_read.xxhash
    restore_file_read = safetensors_io.read
    if when == "after-verify":
        def read_then_tamper(self, where):
            verified = restore_read(self, where)
            for path in data_files(where):
                tamper(path, how)
            return verified

        manager_module.CheckpointManager._read = read_then_tamper
    elif when == "during-read":
        class Tampering:  # xxhash, except that the file being read changes right after its first bytes were hashed
            def __init__(self, real):
                self.real, self.reading, self.done = real, None, set()

            def tamper_current(self):
                if self.reading is not None and self.reading not in self.done:
                    self.done.add(self.reading)
                    tamper(self.reading, how)

            def xxh3_64_hexdigest(self, data):  # a whole mapped file at once: change it first
                self.tamper_current()
                return self.real.xxh3_64_hexdigest(data)

            def xxh3_64(self, *args):
                digest, outer = self.real.xxh3_64(*args), self

                class Digest:
                    def update(self, data):
                        digest.update(data)
                        outer.tamper_current()

                    def __getattr__(self, name):
                        return getattr(digest, name)

                return Digest()

            def __getattr__(self, name):
                return getattr(self.real, name)

        tampering = Tampering(restore_hash)

        def read_tampered(path, *args, **kwargs):
            tampering.reading = path
            try:
                return restore_file_read(path, *args, **kwargs)
            finally:
                tampering.reading = None

        safetensors_io.read = read_tampered
        safetensors_read.xxhash = tampering
    outcome = {"case": case}
    try:
        acc.load_state(directory)
        outcome["raised"] = None
    except CheckpointError as err:
        outcome["raised"] = str(err)
    finally:
        manager_module.CheckpointManager._read, safetensors_read.xxhash = restore_read, restore_hash
        safetensors_io.read = restore_file_read
    if when == "after-load" and outcome["raised"] is None:
        for path in data_files(directory):
            tamper(path, how)
    now = fingerprint(acc)
    outcome["state"] = "saved" if now == saved else "before load" if now == before_load else "other"
    acc.end_training()
    return outcome


def main() -> None:
    backend = sys.argv[1]
    cases = sys.argv[2:] or [f"{how}-{when}" for when in ("after-verify", "during-read", "after-load")
                             for how in ("rewrite", "truncate")]
    with tempfile.TemporaryDirectory() as base:
        for case in cases:
            print("CASE " + json.dumps(run_case(backend, case, base)), flush=True)


if __name__ == "__main__":
    main()
