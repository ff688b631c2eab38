"""Every path that parses a checkpoint's header or manifest stays within the documented bound
(issue 46, finding 1; docs/checkpoints.md#bounds-on-what-a-checkpoint-may-hold): a safetensors
header costs at most 10 times its size in memory, a manifest at most 20 times (or 8 MiB).

Before: only `safetensors_io.parse` was measured; `header_of` and `header_of_file` (the sharded
readers, up to 8 at once on a store) parsed every header twice, the second time whole with
json.loads (14.6 times the size of a header of tiny entries, 19 times with 64-dimension shapes),
and `describe` kept shapes that read refuses (10.2 times). Each path is measured here on the
costliest headers that a reader accepts or must refuse, with `tracemalloc`.
"""
from __future__ import annotations

import io
import itertools
import json
import string
import struct
from typing import Any, Callable, Dict, Iterator, Tuple

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unified.checkpoint import manifest, safetensors_io, safetensors_write
from unified.errors import CheckpointError

from .helpers import peak_of

HEADER_RATIO = 10        # docs/checkpoints.md: parsing a header costs at most 10 times its size
MANIFEST_RATIO = manifest.MAX_PARSE_RATIO  # ... a manifest at most 20 times
MANIFEST_FLOOR = manifest.PARSE_ALLOWANCE  # ... or 8 MiB, for small manifests
SIZE = 1 << 20

_NAME_CHARACTERS = [c for c in string.printable[:94] if c not in '"\\']


def _names() -> Iterator[str]:
    """The shortest distinct names: 92 of one character, then of two..."""
    for length in itertools.count(1):
        for letters in itertools.product(_NAME_CHARACTERS, repeat=length):
            yield "".join(letters)


def _entries(info: str) -> bytes:
    """A header of SIZE bytes at most, every entry ``info`` under the shortest names."""
    parts, total = [], 2
    for name in _names():
        part = f'"{name}":{info}'
        total += len(part) + 1
        if total > SIZE:
            break
        parts.append(part)
    return ("{" + ",".join(parts) + "}").encode()


def _writer_header() -> bytes:
    """The header unified's writer makes for 20000 arrays named as Adam's state is."""
    arrays = {f"optimizer_0/state/{i}/exp_avg_sq": ("F32", (0, 4096), np.zeros(0, np.uint8)) for i in range(20000)}
    return safetensors_write._layout({k: (d, s, r.nbytes) for k, (d, s, r) in arrays.items()})[1][8:]


# Headers that cost the most memory per byte: those every reader accepts (zero-size arrays hold
# no data, so a header of them is all there is), and those it must refuse.
HEADERS: Dict[str, Callable[[], bytes]] = {
    "tiny entries": lambda: _entries('{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'),
    "64 dimensions of 0": lambda: _entries('{"dtype":"U8","shape":[' + ",".join("0" * 64) + '],"data_offsets":[0,0]}'),
    # uncached ints: as many as a shape can hold (their product times the item size below 2**63)
    "7 dimensions of 257":
        lambda: _entries('{"dtype":"U8","shape":[0' + ",1" * 56 + ",257" * 7 + '],"data_offsets":[0,0]}'),
    # more than that: read refuses the shape (NumPy's "array is too big"); header_of kept it
    "63 dimensions of 257": lambda: _entries('{"dtype":"U8","shape":[0' + ",257" * 63 + '],"data_offsets":[0,0]}'),
    "a long name": lambda: json.dumps({"a" * SIZE: {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}).encode(),
    "long metadata": lambda: json.dumps({"__metadata__": {str(i): "v" * 1000 for i in range(1000)},
                                         "w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}).encode(),
    "deep": lambda: b"[" * (SIZE // 2) + b"]" * (SIZE // 2),
    "our writer's": _writer_header,
}




def _paths(raw: bytes, path: str) -> Dict[str, Callable[[], Any]]:
    """Every public call that parses the header of the file ``raw`` (also written at ``path``)."""
    size, checksum = len(raw), xxhash.xxh3_64_hexdigest(raw)

    def read_at(at: int, count: int) -> bytes:
        return raw[at:at + count]

    return {
        "parse": lambda: safetensors_io.parse(raw, "h.safetensors"),
        "header_of": lambda: safetensors_io.header_of(read_at, "h.safetensors", size),
        "header_of_file": lambda: safetensors_io.header_of_file(path),
        "describe": lambda: safetensors_io.describe(read_at, "h.safetensors", size),
        "describe_file": lambda: safetensors_io.describe_file(path, size),
        "read": lambda: safetensors_io.read(path, size, checksum),
        "read_into": lambda: safetensors_io.read_into(path, lambda key, dtype, shape: None),
        "read_stream": lambda: safetensors_io.read_stream(io.BytesIO(raw), "h.safetensors", size, checksum),
        "read_stream_into": lambda: safetensors_io.read_stream_into(io.BytesIO(raw), "h.safetensors", size,
                                                                    lambda key, dtype, shape: None),
    }


PATHS = sorted(_paths(b"", ""))


@pytest.fixture(scope="module")
def header_files(tmp_path_factory) -> Dict[str, Tuple[bytes, bytes, str]]:
    """shape -> (header, file bytes, file path): each built once for every path."""
    folder, files = tmp_path_factory.mktemp("headers"), {}
    for shape, make in HEADERS.items():
        header = make()
        header += b" " * (-len(header) % 8)
        raw = struct.pack("<Q", len(header)) + header
        path = str(folder / f"{shape.replace(' ', '_')}.safetensors")
        with open(path, "wb") as handle:
            handle.write(raw)
        files[shape] = (header, raw, path)
    return files


@pytest.mark.parametrize("shape", sorted(HEADERS))
@pytest.mark.parametrize("reader", PATHS)
def test_every_reader_parses_a_hostile_header_within_ten_times_its_size(header_files, reader, shape):
    header, raw, path = header_files[shape]
    peak, outcome = peak_of(_paths(raw, path)[reader])
    assert not isinstance(outcome, Exception) or isinstance(outcome, CheckpointError), outcome
    assert peak <= HEADER_RATIO * len(header), f"{reader}: {peak / len(header):.1f}x the header ({shape})"


def test_every_reader_agrees_on_shapes_numpy_refuses(header_files):
    """A zero-size array whose other dimensions multiply beyond 2**63 bytes: `read` cannot make
    it (NumPy refuses), so `header_of` and `describe` refuse it too, rather than plan a load that
    fails later (and keep 63 Python ints per entry meanwhile)."""
    _, raw, path = header_files["63 dimensions of 257"]
    for reader, call in _paths(raw, path).items():
        with pytest.raises(CheckpointError, match="dimensions") as raised:
            call()
        assert "h.safetensors" in str(raised.value) or path in str(raised.value), reader


def test_header_of_still_gives_the_metadata_and_entries(tmp_path):
    path = str(tmp_path / "m.safetensors")
    arrays = {"w": safetensors_io.export_numpy(np.arange(3, dtype=np.float32)),
              "e": safetensors_io.export_numpy(np.zeros((0, 5), np.int64))}
    metadata = {"format": "pt", "escaped": 'a "quoted" \\ value \u00e9', "": ""}
    safetensors_io.write(path, arrays, metadata)
    size, start, entries = safetensors_io.header_of_file(path)
    with open(path, "rb") as handle:
        raw = handle.read()
    assert size == len(raw) and start == 8 + struct.unpack_from("<Q", raw)[0]
    assert entries == {"e": ("I64", (0, 5), 0, 0), "w": ("F32", (3,), 0, 12)}
    got = safetensors_io.header_of(lambda at, count: raw[at:at + count], path, size)
    assert got == (start, entries, metadata)


# -- manifests -------------------------------------------------------------------------------------

def _signed(structure: Any) -> bytes:
    """A compact manifest holding ``structure``, with a correct checksum: a hostile manifest
    passes it, so reading goes all the way through `check_manifest`."""
    body = {"format": manifest.FORMAT, "format_version": manifest.FORMAT_VERSION, "backend": "torch",
            "num_processes": 1, "iteration": 0, "objects": [], "structures": {"x": structure}, "sharded": {},
            "files": {}}
    return json.dumps({**body, "manifest_xxh3": manifest._digest(body)}, separators=(",", ":")).encode()


# The JSON that costs the most per byte among what `parse_manifest_json` accepts (its estimate
# below 20 times the size): dense short strings, ints and keys.
MANIFESTS: Dict[str, Callable[[int], Any]] = {
    "short strings": lambda size: ["ab"] * (size // 5),
    "ints": lambda size: [300] * (size // 4),
    "keys": lambda size: {"k%08d" % i: 0 for i in range(size // 14)},
}


@pytest.mark.parametrize("size", [450_000, SIZE], ids=["440KiB", "1MiB"])
@pytest.mark.parametrize("shape", sorted(MANIFESTS))
@pytest.mark.parametrize("reader", ["read_manifest", "store"])
def test_every_manifest_reader_stays_within_twenty_times_its_size(tmp_path, reader, shape, size):
    """``read_manifest`` (a folder) and what `ObjectStore.read_manifest` runs on the object's
    bytes (`parse_manifest_json`, then `check_manifest` with its checksum). At 440 KiB the
    checksum's re-serialisation took the manifest to 20.2 times its size, beyond both 20 times
    and the 8 MiB floor."""
    raw = _signed(MANIFESTS[shape](size))
    (tmp_path / manifest.MANIFEST).write_bytes(raw)
    assert manifest.json_parse_cost(raw)[1] <= MANIFEST_RATIO * len(raw)  # accepted: the costliest kind

    def store() -> Any:
        text = raw  # the store's read holds the object's bytes meanwhile
        return manifest.check_manifest(manifest.parse_manifest_json(text, "s3://b/manifest.json"), "s3://b")

    call = (lambda: manifest.read_manifest(str(tmp_path))) if reader == "read_manifest" else store
    peak, outcome = peak_of(call)
    assert isinstance(outcome, dict), outcome
    bound = max(MANIFEST_RATIO * len(raw), MANIFEST_FLOOR)
    assert peak <= bound, f"{reader}: {peak / len(raw):.1f}x the manifest ({shape}, {len(raw)} bytes)"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=3), inner, max_size=6)
    | st.tuples(inner, inner), max_leaves=60)


def _reference(body: Any) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=json_values, small=st.sampled_from([0, 7, 10 ** 9]), part=st.integers(1, 12))
def test_the_checksum_made_in_parts_is_the_checksum_of_the_whole_text(monkeypatch, body, small, part):
    """`_digest` encodes a document in parts of `_DIGEST_PIECES` pieces (a small one) or hashes
    the C encoder's pieces as they come (a large one): the text hashed is json.dumps' all the same."""
    monkeypatch.setattr(manifest, "_SMALL_DOCUMENT", small)
    monkeypatch.setattr(manifest, "_DIGEST_PIECES", part)
    monkeypatch.setattr(manifest, "_DIGEST_SLICE", 5)
    assert manifest._digest(body) == _reference(body)


def test_the_checksum_of_large_and_nested_documents_is_unchanged():
    for body in ([[["ab"] * 200_000]],
                 {"a": [[1, 2], {"c": [3] * 9000}] * 3, "b": {str(i): [i] for i in range(30_000)}},
                 {"x": [{"k%d" % i: [i, "\u00e9\U0001F600"]} for i in range(10_000)]}, {1: "int keys", 2: [3]}, {}, []):
        assert manifest._digest(body) == _reference(body)
