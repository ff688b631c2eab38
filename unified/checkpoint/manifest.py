"""The checkpoint manifest: what a complete checkpoint holds, with sizes and checksums.

``manifest.json`` is written last, by the main process, inside the temporary directory just
before the atomic rename; a directory without a valid manifest is never a checkpoint.

Reading treats the manifest as hostile until proven otherwise: its checksum is no protection
(anyone can compute one), so every field is checked for the type the loader relies on, and the
cost of reading it is bounded in time and memory before it is parsed (see `MAX_MANIFEST_BYTES`,
`MAX_MANIFEST_DEPTH`, `MAX_PARSE_RATIO`, `PARSE_ALLOWANCE` and the file name bounds).
"""
from __future__ import annotations

import json
import os
import re
import stat
from typing import Any, Callable, Dict, Optional, Set, Tuple

import numpy as np
import xxhash

from ..errors import CheckpointError, see
from .codec import MAX_DEPTH as _STRUCTURE_DEPTH

FORMAT = "unified-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# The manifest grows by ~400 bytes of indented JSON per parameter tensor trained with Adam
# (its entry in the model's structure and its exp_avg, exp_avg_sq and step entries in the
# optimizer's): 64 MiB is ~150k such tensors, several times the largest models we know of.
MAX_MANIFEST_BYTES = 64 << 20
# The document, then its "structures" object, then each object's structure (`codec.MAX_DEPTH`).
MAX_MANIFEST_DEPTH = _STRUCTURE_DEPTH + 2
# json.loads may need at most this multiple of the manifest's size in memory, as estimated by
# `json_parse_cost` before parsing (an upper bound; actual use is 1.5 to 3 times lower).
# Manifests our writer produces estimate at 7-18x (they take 2-7x); dense hostile JSON (empty
# lists, tiny dicts, short strings) would take up to 30x, and is refused. Measured peaks of
# read_manifest: ~370 MiB for a 63 MiB manifest our writer made (Adam on 135k tensors), ~925 MiB
# for the costliest 64 MiB still accepted (dense short strings, 14.5x).
MAX_PARSE_RATIO = 20
# ... except that an estimate below this is always fine: small manifests have more overhead per
# byte (short names, a non-ASCII escape that widens every string in the estimate).
PARSE_ALLOWANCE = 8 << 20
# File names. Orbax, which writes the only nested names (``sharded.orbax/...``), writes at most
# 4 parts with OCDBT, the layout our JAX backend uses (``sharded.orbax/ocdbt.process_N/d/<32
# hex digits>``); plain zarr3 chunk keys would add one part per array dimension (3 + rank).
# 16 parts leaves room for both; 255 is NAME_MAX of Linux file systems and 4096 PATH_MAX.
MAX_NAME_PARTS = 16
MAX_PART_CHARS = 255
MAX_NAME_CHARS = 4096
_SAFE_PART = f"[A-Za-z0-9_.-]{{1,{MAX_PART_CHARS}}}"
_SAFE_NAME = re.compile(f"{_SAFE_PART}(?:/{_SAFE_PART}){{0,{MAX_NAME_PARTS - 1}}}")
_CHECKSUM = re.compile("[0-9a-f]{16}")
# Fields the loader reads, and the types it needs (absent ones are left to the loader: manifests
# written before arrays could be sharded have no "sharded").
_FIELD_TYPES = {"backend": (str, "a string"), "num_processes": (int, "an integer"), "iteration": (int, "an integer"),
                "objects": (list, "a list of strings"), "structures": (dict, "a mapping"),
                "sharded": (dict, "a mapping of strings"),
                # what save-state hooks wrote (`Accelerator.register_save_state_pre_hook`): their
                # files, listed in 'files' too, and the models they saved instead of unified
                "hook_files": (list, "a list of strings"), "hook_objects": (list, "a list of strings"),
                # the experiment trackers' runs (name -> identity), continued by a resumed job
                "trackers": (dict, "a mapping"),
                # a checkpoint whose processes saved to folders of their own (docs/checkpoints.md):
                # the process whose folder this is, and the save's token, the same in every folder
                "process_folder": (int, "an integer"), "save": (str, "a string")}

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


# Checksumming a manifest re-serialises it: json's C encoder (CPython 3.11) gathers up to 100k
# pieces of text (~4 MB) before it joins them, then holds all of its output and json.dumps
# joins and encodes that again. A document of up to _SMALL_DOCUMENT pieces (~1.5 MB of dense
# JSON, where those 4 MB would be several times its size) is therefore encoded in parts of
# _DIGEST_PIECES pieces; a larger one by the C encoder whole (its 4 MB then a small part of the
# document), its pieces hashed one by one, never joined.
_SMALL_DOCUMENT = 600_000
_DIGEST_PIECES = 8192
_DIGEST_SLICE = 64 << 10
_CONTAINERS = (dict, list, tuple)


def _digest(body: Dict[str, Any]) -> str:
    """The xxh3 of ``json.dumps(body, sort_keys=True, separators=(",", ":")).encode()``, hashed
    as the text is made (see _SMALL_DOCUMENT): checking a manifest's checksum never holds a
    copy of the manifest, nor several times a small one's size in the encoder's pieces."""
    digest = xxhash.xxh3_64()
    pending: list = []
    held = 0

    def emit(text: str) -> None:
        nonlocal held
        pending.append(text)
        held += len(text)
        if held >= _DIGEST_SLICE:
            digest.update("".join(pending).encode("ascii"))  # ASCII: json.dumps escapes the rest
            pending.clear()
            held = 0

    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
    if _pieces(body, _SMALL_DOCUMENT) is not None:
        _encode_in_parts(body, emit, encoder.encode)
    else:  # the C encoder's pieces (CPython 3.12 on gives one), hashed a slice at a time
        for piece in encoder.iterencode(body, _one_shot=True):
            for start in range(0, len(piece), _DIGEST_SLICE):
                emit(piece[start:start + _DIGEST_SLICE])
    digest.update("".join(pending).encode("ascii"))
    return digest.hexdigest()


def _pieces(value: Any, most: int) -> Optional[int]:
    """How many pieces json's encoder makes of ``value`` (an upper bound), or None when more
    than ``most``. Containers of plain values are counted at C speed, without visiting them."""
    if type(value) not in _CONTAINERS:
        return 1
    items = value.values() if type(value) is dict else value
    count = 4 * len(value) + 2  # per item a key, a value and two separators; the brackets
    if count > most:
        return None
    if set(map(type, items)).isdisjoint(_CONTAINERS):
        return count
    for item in items:
        if type(item) in _CONTAINERS:
            inner = _pieces(item, most - count)
            if inner is None:
                return None
            count += inner
    return count


def _encode_in_parts(value: Any, emit: Callable[[str], None], dumps: Callable[[Any], str]) -> None:
    """``emit`` the text of ``dumps(value)`` in order, in parts of at most `_DIGEST_PIECES`
    pieces: a larger list or mapping is encoded a run of its items at a time, the items too
    large themselves part by part. (A mapping with keys other than strings goes whole: json
    converts such keys, and sorts them before it does; a manifest read back has none.)"""
    if type(value) not in _CONTAINERS or _pieces(value, _DIGEST_PIECES) is not None:
        emit(dumps(value))
        return
    mapping = type(value) is dict
    if mapping and set(map(type, value)) != {str}:
        emit(dumps(value))
        return
    keys = sorted(value) if mapping else range(len(value))
    run: list = []
    load, first = 0, True

    def flush() -> None:
        nonlocal run, load, first
        if run:
            text = dumps(dict(run) if mapping else [item for _, item in run])
            emit(("" if first else ",") + text[1:-1])
            run, load, first = [], 0, False

    emit("{" if mapping else "[")
    for key in keys:
        item = value[key]
        count = _pieces(item, _DIGEST_PIECES)
        if count is None:
            flush()
            emit(("" if first else ",") + (dumps(key) + ":" if mapping else ""))
            _encode_in_parts(item, emit, dumps)
            first = False
            continue
        if load + count > _DIGEST_PIECES:
            flush()
        run.append((key, item))
        load += count + 2
    flush()
    emit("}" if mapping else "]")


def manifest_bytes(body: Dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` for ``body``, with the format and its own checksum."""
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, **body}
    document = {**body, "manifest_xxh3": _digest(body)}
    return json.dumps(document, indent=1, sort_keys=True).encode()


def write_manifest(directory: str, body: Dict[str, Any]) -> None:
    """Write ``manifest.json`` (with its own checksum) and fsync it."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "wb") as handle:
        handle.write(manifest_bytes(body))
        handle.flush()
        os.fsync(handle.fileno())


# -- opening files that may be hostile -------------------------------------------------------------

def _refuse_special(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "an unknown kind of file")
        raise CheckpointError(f"{path}: not a regular file ({kind}); refusing to open it. A checkpoint holds only "
                              "regular files: put the file itself there, or load another checkpoint."
                              + see("not-a-regular-file"))


def open_regular_file(path: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (not a link, FIFO,
    device, socket or directory), so that opening it can neither block nor leave the checkpoint.

    The type is checked before opening (``lstat``) and again on the descriptor (``fstat``), so a
    file swapped in between is refused too; ``O_NONBLOCK`` keeps even that open from waiting for
    a FIFO's writer, ``O_NOFOLLOW`` from following a link. Raises `OSError` when the file cannot
    be examined or opened (the caller says what is missing) and `CheckpointError` naming it when
    it is not a regular file.
    """
    _refuse_special(path, os.lstat(path).st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        _refuse_special(path, os.fstat(fd).st_mode)
    except CheckpointError:
        os.close(fd)
        raise
    return fd


# -- JSON whose parsing must stay cheap ------------------------------------------------------------

_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
# Digits -> "0"; what may come before a number ([,: whitespace and the minus sign) -> " ";
# anything else -> "x": each " 0" is then the start of a number (or of digits in a string).
_NUMBER_STARTS = bytes(48 if 48 <= c <= 57 else 32 if c in b"[,: \t\n\r-" else 120 for c in range(256))
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]")  # a character beyond U+FFFF
_WIDE_ESCAPE = re.compile(rb"\\u(?!00)")              # a character beyond U+00FF
# The most bytes json.loads allocates per item (CPython 3.10-3.12, 64-bit; measured with
# tracemalloc over 1 to 350k entries, growth included: while a dict or list grows, its old and
# new tables are both alive). A dict of e entries costs at most 144 + 100 e, a list of n
# elements 96 + 16 n, a string 64 plus per character 1 (ASCII and Latin-1), up to 4 (UCS-2) or
# 7 (UCS-4) while it is built, a number at most 40 (one-digit ints are cached).
_COST_DICT, _COST_ENTRY, _COST_LIST, _COST_ELEMENT, _COST_STRING, _COST_NUMBER = 144, 100, 96, 16, 64, 40


def _nesting(skeleton: bytes) -> int:
    """The deepest nesting of a string of brackets (``[{`` open, ``]}`` close)."""
    steps = np.frombuffer(skeleton.translate(_BRACKET_STEP), dtype=np.int8)
    deepest = level = 0
    for start in range(0, len(steps), 1 << 20):  # in slices: the running sum is 8 bytes a bracket
        levels = np.cumsum(steps[start:start + (1 << 20)], dtype=np.int64) + level
        deepest, level = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def json_parse_cost(raw: bytes) -> Tuple[int, int]:
    """``(bracket nesting, most bytes json.loads(raw) can allocate)`` of ASCII JSON ``raw``.

    Counts the characters that make containers, entries, elements, strings and numbers,
    without building anything (at most one copy of ``raw`` at a time, C speed). Characters
    inside strings are counted too, which only raises the cost, so the cost is an upper bound;
    the nesting is not one (``"]"`` in a string closes nothing), so readers of the parsed
    document bound its depth again where they walk it (`codec.decode`).
    """
    width = 1 if b"\\u" not in raw else 7 if _SURROGATE_ESCAPE.search(raw) else 4 if _WIDE_ESCAPE.search(raw) else 1
    dicts, lists = raw.count(b"{"), raw.count(b"[")
    cost = (len(raw) * (1 + width) + _COST_DICT * dicts + _COST_ENTRY * raw.count(b":") + _COST_LIST * lists
            + _COST_ELEMENT * (raw.count(b",") + lists) + _COST_STRING * (raw.count(b'"') // 2)
            + _COST_NUMBER * (raw.translate(_NUMBER_STARTS).count(b" 0") + 1))
    return _nesting(raw.translate(None, _NOT_BRACKET)), cost


def parse_manifest_json(raw: bytes, path: str) -> Any:
    """``json.loads(raw)`` once the manifest is known to be ASCII (as our writer makes it), not
    nested beyond `MAX_MANIFEST_DEPTH` and cheap enough to parse (`MAX_PARSE_RATIO`)."""
    if not raw.isascii():
        raise CheckpointError(f"{path}: not a valid manifest (it holds non-ASCII bytes; unified writes it as ASCII "
                              "JSON)." + see("manifest-invalid"))
    depth, cost = json_parse_cost(raw)
    if depth > MAX_MANIFEST_DEPTH:
        raise CheckpointError(f"{path}: nested {depth} levels deep; unified writes at most {MAX_MANIFEST_DEPTH}. "
                              "Refusing to parse it: the file is damaged or hostile." + see("manifest-too-costly"))
    if cost > max(MAX_PARSE_RATIO * len(raw), PARSE_ALLOWANCE):
        raise CheckpointError(
            f"{path}: parsing it could take {cost / 2**20:.1f} MiB for {len(raw) / 2**20:.1f} MiB of JSON, more than "
            f"{MAX_PARSE_RATIO} times its size, which no manifest unified writes needs (too many tiny values). "
            "Refusing to parse it: the file is damaged or hostile." + see("manifest-too-costly"))
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # RecursionError: nesting hidden by brackets in strings
        raise CheckpointError(f"{path}: not a valid manifest ({err})." + see("manifest-invalid")) from err


# -- reading the manifest --------------------------------------------------------------------------

def _shown(name: Any) -> str:
    text = repr(name)
    return text if len(text) <= 100 else f"{text[:80]}... ({len(text)} characters)"


def _refuse_links(directory: str, folders: Any, checked: Set[str]) -> None:
    """Refuse a symbolic link among the ``folders`` leading to a listed file; each existing
    folder is examined once (``checked``), and none below one that does not exist."""
    path = directory
    for part in folders:
        path = os.path.join(path, part)
        if path in checked:
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return  # missing: opening the file will say so
        if stat.S_ISLNK(mode):
            raise CheckpointError(f"{path}: a link inside the checkpoint; refusing to follow it."
                                  + see("link-inside-checkpoint"))
        checked.add(path)


def check_file_name(directory: str, name: str, checked: Optional[Set[str]] = None) -> str:
    """The path of manifest entry ``name`` (plain names, or ``/``-separated plain names below
    the checkpoint), refusing anything that could leave ``directory`` or costs more than
    `MAX_NAME_PARTS` parts of `MAX_PART_CHARS` characters (`MAX_NAME_CHARS` in all) to check.
    ``checked``: folders already known not to be links (shared across the names of a manifest)."""
    plain = (isinstance(name, str) and len(name) <= MAX_NAME_CHARS and _SAFE_NAME.fullmatch(name) is not None
             and "/./" not in f"/{name}/" and "/../" not in f"/{name}/")
    if not plain:
        raise CheckpointError(
            f"{os.path.join(directory, MANIFEST)}: refusing file name {_shown(name)} (only plain names inside the "
            f"checkpoint are allowed: at most {MAX_NAME_PARTS} '/'-separated parts of [A-Za-z0-9_.-], none '.' or "
            f"'..', each at most {MAX_PART_CHARS} characters, {MAX_NAME_CHARS} in all)." + see("refusing-file-name"))
    parts = name.split("/")
    _refuse_links(directory, parts[:-1], set() if checked is None else checked)
    return os.path.join(directory, *parts)


def read_manifest_document(path: str) -> Any:
    """The JSON document of the manifest at ``path``, parsed within the bounds above but not
    validated; `CheckpointError` when it is missing, not a regular file, too large or not JSON."""
    return parse_manifest_json(_read_manifest_bytes(path), path)


def _read_manifest_bytes(path: str) -> bytes:
    try:
        fd = open_regular_file(path)
    except OSError as err:
        raise CheckpointError(
            f"{path}: missing or unreadable ({err.strerror}); this directory is not a complete checkpoint."
            + see("manifest-missing")
        ) from err
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(fd).st_size
        raw = handle.read(size + 1) if size <= MAX_MANIFEST_BYTES else b""
    if size > MAX_MANIFEST_BYTES or len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes; refusing to parse it."
                              + see("manifest-too-large"))
    return raw


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(body: Dict[str, Any], path: str) -> None:
    for key, (expected, description) in _FIELD_TYPES.items():
        if key not in body:
            continue
        value = body[key]
        well_typed = _is_int(value) if expected is int else isinstance(value, expected)
        if key in ("objects", "hook_files", "hook_objects"):
            well_typed = well_typed and all(isinstance(name, str) for name in value)
        elif key == "sharded":
            well_typed = well_typed and all(isinstance(name, str) for name in value.values())
        if not well_typed:
            raise CheckpointError(f"{path}: field {key!r} must be {description}; found {_shown(value)}. "
                                  "The manifest is damaged or hostile: load another checkpoint."
                                  + see("manifest-field"))


def _check_files(directory: str, files: Any, path: str) -> None:
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' must be a mapping." + see("manifest-files"))
    checked: Set[str] = set()
    for name, info in files.items():
        check_file_name(directory, name, checked)
        if not (isinstance(info, dict) and _is_int(info.get("size")) and info["size"] >= 0
                and isinstance(info.get("xxh3"), str) and _CHECKSUM.fullmatch(info["xxh3"])):
            raise CheckpointError(f"{path}: entry for {_shown(name)} needs a non-negative integer 'size' and an 'xxh3' "
                                  "checksum of 16 hex digits." + see("manifest-files"))


def read_manifest(directory: str) -> Dict[str, Any]:
    """Read and validate ``manifest.json``; raise `CheckpointError` naming the problem."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory." + see("no-such-directory"))
    return check_manifest(read_manifest_document(path), directory)


def check_manifest(document: Any, directory: str) -> Dict[str, Any]:
    """The validated body of the parsed manifest ``document`` of the checkpoint ``directory``
    (a folder or a URL); raise `CheckpointError` naming the problem."""
    path = os.path.join(directory, MANIFEST)
    if not (isinstance(document, dict) and isinstance(document.get("manifest_xxh3"), str)):
        raise CheckpointError(f"{path}: not a valid manifest (expected a JSON object with a 'manifest_xxh3' string)."
                              + see("manifest-invalid"))
    body = {k: v for k, v in document.items() if k != "manifest_xxh3"}
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a unified checkpoint manifest (format {_shown(body.get('format'))})."
                              + see("manifest-format"))
    if not (_is_int(body.get("format_version")) and body["format_version"] == FORMAT_VERSION):
        raise CheckpointError(
            f"{path}: format version {_shown(body.get('format_version'))}; this unified reads version "
            f"{FORMAT_VERSION}. Upgrade unified to load it." + see("manifest-version")
        )
    try:
        digest = _digest(body)
    except RecursionError as err:  # nesting hidden by brackets in strings (see json_parse_cost)
        raise CheckpointError(f"{path}: not a valid manifest (nested too deep to check)."
                              + see("manifest-invalid")) from err
    if document["manifest_xxh3"] != digest:
        raise CheckpointError(f"{path}: the manifest was modified after it was written (checksum mismatch)."
                              + see("manifest-modified"))
    _check_fields(body, path)
    _check_files(directory, body.get("files"), path)
    return body
