"""The safetensors format: dtype names, limits, the errors every reader and writer raises, and
the parser of a header that may be hostile (bounded memory, every entry checked before anything
is built from it); `_lay_out` turns a checked header into arrays that tile the data section.
Reading lives in `safetensors_read`, writing in `safetensors_write`, hashing in `safetensors_hash`.
"""
from __future__ import annotations

import array as stdarray
import json
import math
import os
import re
import struct
from json.decoder import scanstring
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from ..errors import CheckpointError, see
from .manifest import open_regular_file

# safetensors dtype names <-> NumPy dtypes (bfloat16 and float8 come from ml_dtypes when present)
_DTYPES: Dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_BY_NUMPY = {v: k for k, v in _DTYPES.items()}
# safetensors dtype name -> NumPy dtype name: backends derive their own tables from it
DTYPE_NAMES: Mapping[str, str] = dict(_DTYPES)
_ALIGN = 64  # where the writer puts the data section and the arrays of whole multiples of it
# Our writer spends ~70 bytes plus the name on each array; the largest state we know of (Adam on
# a model of ~47k tensors: ~141k arrays named like optimizer_0/state/12345/exp_avg_sq) needs
# ~16 MB. 64 MiB leaves four times that, below the safetensors crate's own 100 MB limit.
MAX_HEADER_BYTES = 64 << 20
MAX_METADATA_ENTRIES = 1024  # the format allows a str -> str mapping (torch DCP's shard files hold 3)
MAX_RANK = 64  # NumPy's limit on dimensions


def numpy_dtype(name: str) -> np.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unknown safetensors dtype {name!r}" + see("invalid-safetensors"))
    try:
        return np.dtype(_DTYPES[name])
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with NumPy)

        return np.dtype(getattr(ml_dtypes, _DTYPES[name]))


def safetensors_dtype(dtype: np.dtype) -> str:
    name = np.dtype(dtype).name
    if name not in _BY_NUMPY:
        raise TypeError(f"arrays of dtype {name} cannot be stored in safetensors." + see("dtype-not-storable"))
    return _BY_NUMPY[name]


from ..backend import Exported  # noqa: E402  (safetensors dtype, shape, contiguous uint8 view of its bytes)


def export_numpy(array: np.ndarray) -> Exported:
    array = np.asarray(array)
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = array.copy(order="C")
    return safetensors_dtype(array.dtype), tuple(array.shape), array.reshape(-1).view(np.uint8)


def _open_for_reading(path: str) -> int:
    try:
        return open_regular_file(path)
    except OSError as err:
        raise cannot_open(path, err) from err


def cannot_open(path: str, err: OSError) -> CheckpointError:
    return CheckpointError(f"{path}: cannot open checkpoint file ({err.strerror})." + see("cannot-open-file"))


def size_mismatch(path: str, actual: int, size: int) -> CheckpointError:
    return CheckpointError(f"{path}: size is {actual} bytes; the manifest says {size}. The file is truncated or "
                           "replaced." + see("size-mismatch"))


def checksum_mismatch(path: str) -> CheckpointError:
    return CheckpointError(f"{path}: checksum mismatch - the file is corrupted or was modified."
                           + see("checksum-mismatch"))


def _ended(fd: int, path: str, size: int) -> CheckpointError:
    return CheckpointError(f"{path}: file ended after {os.fstat(fd).st_size} of {size} bytes (it shrank while it was "
                           "read); nothing was restored." + see("file-ended"))


def _in_file_order(arrays: Dict[str, np.ndarray], starts: List[int]) -> List[Tuple[int, np.ndarray]]:
    """``(offset in the data section, array)`` of `_lay_out`'s result, in file order."""
    return sorted(zip(starts, arrays.values()), key=lambda span: span[0])


def _lay_out(header: str, data_size: int, name: str,
             make: Callable[[str, np.dtype, Tuple[int, ...], int], Any],
             metadata: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, Any], List[int]]:
    """``{key: make(key, dtype, shape, start)}`` for the entries of a header (its text, as
    `_header_text` gives it) whose arrays tile the data section of ``data_size`` bytes exactly,
    and their starts (in the header's order); anything else raises `CheckpointError` naming
    ``name``. ``make`` is never asked for more than ``data_size`` bytes in all. ``metadata``,
    when given, gets the header's ``__metadata__``."""
    arrays: Dict[str, np.ndarray] = {}
    starts, ends = stdarray.array("q"), stdarray.array("q")
    total = 0
    try:
        for key, dtype, shape, start, end in _entries(header, data_size, name, metadata):
            if key in arrays:
                raise _not_safetensors(name, f"entry {_shown(key)} appears twice")
            total += end - start
            if total > data_size:
                raise _not_safetensors(name, f"its arrays overlap or leave bytes of the {data_size}-byte data "
                                             "section unused")
            arrays[key] = make(key, dtype, shape, start)
            starts.append(start)
            ends.append(end)
    except CheckpointError:
        raise
    except ValueError as err:  # malformed strings or numbers, which the shape checks let through
        raise _not_safetensors(name, str(err)) from err
    _check_tiling(np.frombuffer(starts, np.int64), np.frombuffer(ends, np.int64), data_size, name)
    return arrays, list(starts)


# -- parsing a header that may be hostile ----------------------------------------------------------
#
# A header is one JSON object of entries ``name: {"dtype", "shape", "data_offsets"}`` (and an
# optional ``"__metadata__": {str: str}``). Before anything is built from an entry its text must
# have exactly that shape (below), so a hostile header cannot make json build the deep or dense
# structures that cost 20-30 times their size; each entry is then parsed alone, checked, and
# turned into an array view (or `header_of`'s tuple), so the header is never held as Python
# objects in whole, and every reader parses it once, holding only its text (`_header_text`:
# the bytes read are dropped once decoded). Every reader stays within 10 times the header's
# size, hostile or not (tests/unit/test_parse_memory_bounds.py measures each one): peak RSS
# growth at 63 MiB, as our writer makes it (720k arrays) 4.7x for `header_of`, 5.9x for `read`;
# with 1.3M tiny arrays 5.7x and 7.9x, `parse` 8.1x. json.loads of the whole header took 10-28
# times; `header_of` parsed it twice, the second time whole (13-17x), until 2026-12.

_W = r"[ \t\n\r]*"
# Flat character classes only, whose matching needs no memory per character (a repeated group
# would: some 300 bytes per repetition); json.loads checks the exact syntax of each entry after.
_INTS = r"\[[-0-9, \t\n\r]*\]"
_FIELD = rf'(?:"dtype"{_W}:{_W}"[A-Z0-9_]{{1,16}}"|"(?:shape|data_offsets)"{_W}:{_W}{_INTS})'
_INFO = re.compile(rf"\{{{_W}{_FIELD}{_W},{_W}{_FIELD}{_W},{_W}{_FIELD}{_W}\}}")
_SPACE = re.compile(_W)
_INFO_KEYS = {"dtype", "shape", "data_offsets"}


def _not_safetensors(name: str, detail: str) -> CheckpointError:
    return CheckpointError(f"{name}: not a valid safetensors file ({detail})." + see("invalid-safetensors"))


def _after(text: str, at: int, token: str, name: str) -> int:
    """The position after ``token`` (and the spaces around it), which must come next."""
    at = _SPACE.match(text, at).end()
    if not text.startswith(token, at):
        raise _not_safetensors(name, f"expected {token!r} at byte {at} of the header")
    return _SPACE.match(text, at + len(token)).end()


def _header_entries(text: str, name: str, metadata: Optional[Dict[str, str]] = None) -> Iterator[Tuple[str, str]]:
    """``(array name, entry JSON)`` for each entry of the header ``text``, in order, each
    entry's text checked to have the only shape a header allows; ``metadata``, when given, gets
    the pairs of ``__metadata__`` (else nothing of it is kept)."""
    at = _after(text, 0, "{", name)
    more = not text.startswith("}", at)
    while more:
        if not text.startswith('"', at):
            raise _not_safetensors(name, f"expected an array name at byte {at} of the header")
        key, at = scanstring(text, at + 1)
        at = _after(text, at, ":", name)
        if key == "__metadata__":
            end = _metadata_end(text, at, name, metadata)
            yield key, ""
        else:
            match = _INFO.match(text, at)
            if match is None:
                raise _not_safetensors(name, f"entry {_shown(key)} at byte {at} of the header is not "
                                             "{'dtype': name, 'shape': [integers], 'data_offsets': [integers]}")
            end = match.end()
            yield key, match.group()
        at = _SPACE.match(text, end).end()
        more = text.startswith(",", at)
        if more:
            at = _SPACE.match(text, at + 1).end()
    if _after(text, at, "}", name) != len(text):
        raise _not_safetensors(name, "data after the header's closing brace")


def _metadata_end(text: str, at: int, name: str, keep: Optional[Dict[str, str]] = None) -> int:
    """The end of the ``__metadata__`` mapping starting at ``at``: at most MAX_METADATA_ENTRIES
    pairs of strings (escapes allowed: torch's DCP stores JSON there), each string scanned by
    json's C scanner and dropped, so nothing grows with the entries, unless ``keep`` is given:
    then it gets the pairs (at most the header's size in strings; a key given twice keeps its
    last value, as json.loads does)."""
    at = _after(text, at, "{", name)
    if text.startswith("}", at):
        return at + 1
    for _ in range(MAX_METADATA_ENTRIES):
        pair = []
        for token in (":", None):
            if not text.startswith('"', at):
                raise _not_safetensors(name, f"the __metadata__ entry at byte {at} of the header is not a string")
            value, at = scanstring(text, at + 1)
            if keep is not None:
                pair.append(value)
            if token:
                at = _after(text, at, token, name)
        if keep is not None:
            keep[pair[0]] = pair[1]
        at = _SPACE.match(text, at).end()
        if text.startswith("}", at):
            return at + 1
        at = _after(text, at, ",", name)
    raise _not_safetensors(name, f"__metadata__ holds more than {MAX_METADATA_ENTRIES} entries")


def _shown(key: str) -> str:
    text = repr(key)
    return text if len(text) <= 80 else text[:77] + "..."


def _entry(key: str, entry: str, data_size: int, name: str) -> Tuple[np.dtype, List[int], int, int]:
    """``(dtype, shape, start, end)`` of header entry ``entry``, once checked against a data
    section of ``data_size`` bytes."""
    if entry.count(",") > MAX_RANK + 2:  # two between the fields, one in data_offsets
        raise _not_safetensors(name, f"array {_shown(key)} has more than {MAX_RANK} dimensions")
    info = json.loads(entry)
    if set(info) != _INFO_KEYS:
        raise _not_safetensors(name, f"array {_shown(key)} needs 'dtype', 'shape' and 'data_offsets' once each")
    if info["dtype"] not in _DTYPES:
        raise _not_safetensors(name, f"array {_shown(key)} has the unknown dtype {info['dtype']!r}")
    dtype = numpy_dtype(info["dtype"])
    shape, offsets = info["shape"], info["data_offsets"]
    if len(offsets) != 2 or not all(0 <= d < 1 << 63 for d in shape) or len(shape) > MAX_RANK:
        raise _not_safetensors(name, f"array {_shown(key)} needs at most {MAX_RANK} dimensions in [0, 2**63) and "
                                     "two data offsets")
    if math.prod(d for d in shape if d) * dtype.itemsize >= 1 << 63:  # even with a dimension of 0, as NumPy
        raise _not_safetensors(name, f"array {_shown(key)} has dimensions whose product, times its item size, is "
                                     "2**63 or more (NumPy cannot make it)")
    start, end = offsets
    if not 0 <= start <= end <= data_size or end - start != math.prod(shape) * dtype.itemsize:
        raise _not_safetensors(name, f"array {_shown(key)} has inconsistent offsets/shape")
    return dtype, shape, start, end


def _header_length(prefix: bytes, most: int, name: str) -> int:
    """The header length that the file's first 8 bytes state, if the file can hold it."""
    if len(prefix) < 8:
        raise _not_safetensors(name, f"{len(prefix)} bytes, fewer than the 8 of the header length")
    (length,) = struct.unpack_from("<Q", prefix, 0)
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{name}: the safetensors header is {length} bytes; unified reads headers of at most "
                              f"{MAX_HEADER_BYTES} bytes. The file is damaged or hostile: load another checkpoint."
                              + see("header-too-large"))
    if length > most:
        raise _not_safetensors(name, f"header of {length} bytes in a file of {most + 8}")
    return length


def _header_text(header: Any, name: str) -> str:
    """The text of a header (its bytes, or a buffer of them: decoded without a copy), which must
    be ASCII, as JSON can always be written. The readers keep only this text while they parse:
    one copy of the header, whatever held its bytes is dropped first."""
    try:
        return str(header, "ascii")
    except UnicodeDecodeError:
        raise _not_safetensors(name, "the header is not ASCII JSON; unified writes names with \\u escapes") from None


def _entries(header: str, data_size: int, name: str, metadata: Optional[Dict[str, str]] = None
             ) -> Iterator[Tuple[str, np.dtype, List[int], int, int]]:
    """``(name, dtype, shape, start, end)`` of each array of the header text ``header``, checked
    one by one (the caller refuses names seen twice and checks that the arrays tile the data
    section); ``metadata``, when given, gets its ``__metadata__``."""
    has_metadata = False
    for key, entry in _header_entries(header, name, metadata):
        if key == "__metadata__":
            if has_metadata:
                raise _not_safetensors(name, f"entry {_shown(key)} appears twice")
            has_metadata = True
        else:
            yield (key, *_entry(key, entry, data_size, name))


def parse(buffer: Any, name: str) -> Dict[str, np.ndarray]:
    """Zero-copy NumPy views of the arrays in a safetensors buffer, with strict validation:
    anything else than a well-formed header of at most `MAX_HEADER_BYTES` whose arrays tile the
    data section raises `CheckpointError` naming ``name``."""
    length = _header_length(bytes(buffer[:8]), len(buffer) - 8, name)
    data_start, data_size = 8 + length, len(buffer) - 8 - length
    text = _header_text(memoryview(buffer)[8:data_start], name)  # decoded from the buffer itself: no copy
    return _lay_out(text, data_size, name, lambda key, dtype, shape, start: np.frombuffer(
        buffer, dtype=dtype, count=math.prod(shape), offset=data_start + start).reshape(shape))[0]


def _check_tiling(starts: np.ndarray, ends: np.ndarray, size: int, name: str) -> None:
    """The arrays cover the data section exactly, as the format requires: no byte of it unused
    and none in two arrays (restored objects keep their arrays' memory, so none may share it)."""
    order = np.lexsort((ends, starts))
    starts, ends = starts[order], ends[order]
    tiled = size == 0 if not len(starts) else \
        starts[0] == 0 and ends[-1] == size and np.array_equal(starts[1:], ends[:-1])
    if not tiled:
        raise _not_safetensors(name, f"its arrays overlap or leave bytes of the {size}-byte data section unused")
