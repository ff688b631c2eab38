"""Where checkpoints live: a folder of the file system, or an object store named by an fsspec URL.

The checkpoint manager does the same steps everywhere (write each process's files, write the
manifest last, apply retention); a `Location` is the part that differs, with the commit as its
own step, as Orbax's atomicity strategies are; `location_of` gives a path's:

* `Folder` (here): files go into a temporary folder beside the checkpoint; the commit writes the
  manifest, fsyncs every file and folder, and renames the folder into place (atomic).
* `ObjectStore` (``s3://``, ``gs://``, any fsspec URL; `object_store`, over `store_client`):
  there is no rename, so the files go straight to the checkpoint's prefix and the manifest,
  written last in one request, is the commit; files are streamed and hashed in the same pass.
  What a backend's sharded reader needs of its objects (`headers_of`, `private_copy`):
  `store_reads`.

The names of those modules are also imported from here (``from unified.checkpoint.store import
ObjectStore``), as before they moved.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..config import is_url
from . import layout, safetensors_io
from .manifest import MANIFEST, read_manifest, write_manifest
from .object_store import DAMAGED_MANIFEST, PART_BYTES, ObjectStore  # noqa: F401 - imported from here too
from .store_client import EXTRAS, StoreError  # noqa: F401 - imported from here too
from .store_reads import Header, headers_of, private_copy  # noqa: F401 - imported from here too
from .types import Location


class Folder:
    """Checkpoints in a folder of the file system (shared by every machine of a multi-host job)."""

    atomic_replace = True

    def numbered(self, folder: str) -> List[Tuple[int, str]]:
        return layout.numbered_checkpoints(folder)

    def highest_number(self, folder: str) -> Optional[int]:
        return layout.highest_number(folder)

    def taken(self, folder: str, number: int) -> bool:
        return layout.number_taken(folder, number)

    def damaged(self, folder: str) -> List[Tuple[int, str]]:
        return layout.damaged_checkpoints(folder)

    def set_aside_damaged(self, checkpoint: str) -> str:
        """Rename the damaged ``checkpoint`` to ``checkpoint_N.damaged`` (see `layout.set_aside_damaged`)."""
        return layout.set_aside_damaged(checkpoint)

    def refusal(self, target: str) -> Optional[str]:
        foreign = layout.foreign_entries(target)
        if foreign:
            return (f"the directory holds {', '.join(foreign[:5])}, which no checkpoint wrote, and saving replaces the "
                    "directory whole. Pass another output_dir or use automatic naming.")
        return None

    def staging(self, final: str, token: str) -> str:
        return layout.temporary_dir(final, token)

    def write(self, path: str, arrays: Mapping[str, Any], live: bool, metadata: Mapping[str, str] = ()
              ) -> Dict[str, object]:
        return safetensors_io.write(path, arrays, metadata, live=live)

    def prepare(self, staging: str) -> None:
        # the folders a first save creates above the checkpoint (project_dir/checkpoints...) are made
        # durable here; the temporary folder itself is, with its contents, by the commit (`fsync_tree`)
        layout.make_dirs(os.path.dirname(os.path.abspath(staging)))
        os.makedirs(staging, exist_ok=True)

    def commit(self, staging: str, final: str, token: str, body: Dict[str, Any]) -> None:
        write_manifest(staging, body)
        layout.fsync_tree(staging)  # contents before the name: a power loss never leaves a torn checkpoint
        layout.commit(staging, final, token)

    def discard(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def after_commit(self, final: str, automatic: bool, total_limit: Optional[int], leased: bool = True) -> None:
        """Delete what crashed saves left beside ``final``, then (automatic naming) the oldest
        checkpoints beyond ``total_limit``; raises `OSError` when a retention delete fails.
        ``leased`` is for stores: a folder's main process holds its lock (`lock`) throughout."""
        parent = os.path.dirname(os.path.abspath(final))
        layout.remove_stale_temporaries(parent)
        if automatic:
            layout.apply_retention(parent, total_limit, keep=final)

    def has_manifest(self, directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, MANIFEST))

    def read_manifest(self, directory: str) -> Dict[str, Any]:
        return read_manifest(directory)

    def read(self, path: str, size: int, checksum: str) -> Dict[str, np.ndarray]:
        return safetensors_io.read(path, size, checksum)

    # -- loads in bounded memory: verify first, then read into the live arrays (see the manager)
    def verify(self, path: str, size: int, checksum: str, copy_to: Optional[str] = None) -> Any:
        """Hash the file in a bounded buffer and compare; returns its identity for `changed`.
        (``copy_to`` is for stores: a file here is read again from where it is.)"""
        return safetensors_io.verify_for_reader(path, size, checksum)

    def describe(self, path: str, size: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        return safetensors_io.describe_file(path, size)

    def changed(self, path: str, identity: Any) -> bool:
        return safetensors_io.changed_since(path, identity)

    def read_placed(self, path: str, size: int, checksum: str, into: Mapping[str, np.ndarray]
                    ) -> Tuple[Dict[str, np.ndarray], List[str]]:
        return safetensors_io.read_placed(path, size, checksum, into)

    # -- an async save's part reports: each process's, for the main process that commits
    report_poll_seconds = 0.01

    def post_report(self, path: str, report: Dict[str, Any]) -> None:
        """Leave ``report`` at ``path`` atomically (the main process polls with `take_report`)."""
        with open(path + ".partial", "w") as handle:
            json.dump(report, handle)
        os.replace(path + ".partial", path)

    def take_report(self, path: str) -> Optional[Dict[str, Any]]:
        """The report at ``path``, removed; None while there is none."""
        if not os.path.exists(path):
            return None
        with open(path) as handle:
            report = json.load(handle)
        os.remove(path)
        return report


def location_of(path: str) -> Location:
    """The `Location` of a checkpoint path: an `ObjectStore` for a URL, else a `Folder`."""
    return ObjectStore(path) if is_url(path) else Folder()
