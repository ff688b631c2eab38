"""A checkpoint file changed between a load's two passes (tests/unit/test_bounded_load*.py)."""
from __future__ import annotations

import os

from unified.checkpoint import store


def flip_a_byte(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 1]))


def change_after_verification(monkeypatch, name: str, seen: bool = True) -> None:
    """Flip a byte of the file ending with ``name`` right after the load's first pass verified it;
    ``seen=False``: the load's check that nothing changed before the second pass does not see it
    (as if it changed while it was read)."""
    verify = store.Folder.verify

    def verify_then_change(self, path, size, checksum, **options):
        identity = verify(self, path, size, checksum, **options)
        if path.endswith(name):
            flip_a_byte(path)
        return identity

    monkeypatch.setattr(store.Folder, "verify", verify_then_change)
    if not seen:
        monkeypatch.setattr(store.Folder, "changed", lambda self, path, identity: False)
