"""The checkpoint manifest: what a complete checkpoint holds, with sizes and checksums.

``manifest.json`` is written last, by the main process, inside the temporary directory just
before the atomic rename; a directory without a valid manifest is never a checkpoint.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict

import xxhash

from ..errors import CheckpointError, see

FORMAT = "unified-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _digest(body: Dict[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(directory: str, body: Dict[str, Any]) -> None:
    """Write ``manifest.json`` (with its own checksum) and fsync it."""
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, **body}
    document = {**body, "manifest_xxh3": _digest(body)}
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as handle:
        json.dump(document, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def check_file_name(directory: str, name: str) -> str:
    """The path of manifest entry ``name`` (plain names, or ``/``-separated plain names below
    the checkpoint), refusing anything that could leave ``directory``."""
    parts = name.split("/") if isinstance(name, str) else [None]
    if not all(isinstance(p, str) and _SAFE_NAME.match(p) and p not in (".", "..") for p in parts):
        raise CheckpointError(f"{os.path.join(directory, MANIFEST)}: refusing file name {name!r} (only plain names inside the checkpoint are allowed)"
                              + see("refusing-file-name"))
    path = os.path.join(directory, *parts)
    if any(os.path.islink(os.path.join(directory, *parts[:i])) for i in range(1, len(parts))):
        raise CheckpointError(f"{path}: a link inside the checkpoint; refusing to follow it" + see("link-inside-checkpoint"))
    return path


def read_manifest(directory: str) -> Dict[str, Any]:
    """Read and validate ``manifest.json``; raise `CheckpointError` naming the problem."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory" + see("no-such-directory"))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise CheckpointError(
            f"{path}: missing or unreadable ({err.strerror}); this directory is not a complete checkpoint"
            + see("manifest-missing")
        ) from err
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes; refusing to parse it" + see("manifest-too-large"))
    try:
        document = json.loads(raw)
        body = {k: v for k, v in document.items() if k != "manifest_xxh3"}
        stated = document["manifest_xxh3"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: not a valid manifest ({err})" + see("manifest-invalid")) from err
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a unified checkpoint manifest (format {body.get('format')!r})" + see("manifest-format"))
    if body.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {body.get('format_version')!r}; this unified reads version {FORMAT_VERSION}. "
            "Upgrade unified to load it." + see("manifest-version")
        )
    if stated != _digest(body):
        raise CheckpointError(f"{path}: the manifest was modified after it was written (checksum mismatch)" + see("manifest-modified"))
    files = body.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' must be a mapping" + see("manifest-files"))
    for name, info in files.items():
        check_file_name(directory, name)
        if not (isinstance(info, dict) and isinstance(info.get("size"), int) and info["size"] >= 0
                and isinstance(info.get("xxh3"), str)):
            raise CheckpointError(f"{path}: entry for {name!r} needs a non-negative 'size' and an 'xxh3' checksum"
                                  + see("manifest-files"))
    return body
