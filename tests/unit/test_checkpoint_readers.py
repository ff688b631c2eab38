"""The checkpoint readers facing damaged or hostile files (issue 11, findings 2, 3, 5 and 6).

Every reader (`read_manifest`, `safetensors_io.read` / `verify_file` / `parse`, `codec.decode`)
must answer any input with a `CheckpointError` naming the file, quickly, within a small
multiple of the input's size in memory, and without blocking on special files.
"""
from __future__ import annotations

import json
import math
import os
import socket
import stat
import struct
import threading
import time
from typing import Any, Callable, Dict

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unified.checkpoint import codec, layout, safetensors_io
from unified.checkpoint.manifest import MANIFEST, check_file_name, read_manifest, write_manifest
from unified.errors import CheckpointError

from .helpers import peak_of

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Peak memory (tracemalloc) of reading, as a multiple of the document's size; measured at most
# 14x for manifests (reading includes the checksum's re-serialisation) and 7.4x for headers
# on the 1 MiB inputs below, and at the 64 MiB caps ~14.5x and ~8x (peak RSS growth; see
# docs/checkpoints.md#bounds-on-what-a-checkpoint-may-hold). Before: 22-64x and 10-28x.
MANIFEST_PARSE_RATIO = 16
HEADER_PARSE_RATIO = 10


def _body(files: Dict[str, Any], **fields: Any) -> Dict[str, Any]:
    body = {"backend": "torch", "num_processes": 1, "iteration": 0, "objects": [], "structures": {},
            "sharded": {}, "files": files}
    body.update(fields)
    return body


def _signed(directory: str, document: Any) -> None:
    """Write ``document`` as manifest.json with a correct manifest_xxh3 when it is a mapping:
    a hostile manifest passes the checksum, so every check after it must hold on its own."""
    if isinstance(document, dict):
        body = {"format": "unified-checkpoint", "format_version": 1, **document}
        digest = xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
        document = {**body, "manifest_xxh3": digest}
    with open(os.path.join(directory, MANIFEST), "w") as handle:
        json.dump(document, handle)




def _safetensors(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _write(path: str, content: bytes) -> Dict[str, Any]:
    with open(path, "wb") as handle:
        handle.write(content)
    return {"size": len(content), "xxh3": xxhash.xxh3_64_hexdigest(content)}


# -- finding 2: file names are bounded, and checked in linear time ---------------------------------

def test_a_name_of_20000_parts_is_refused_at_once(tmp_path):
    _signed(str(tmp_path), _body({"/".join(["a"] * 20000): {"size": 1, "xxh3": "0" * 16}}))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="refusing file name"):
        read_manifest(str(tmp_path))
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("name", ["/".join(["p"] * 17), "a" * 256, "/".join(["b" * 200] * 16) + "x" * 900,
                                  "a//b", "a/", "/a", "a/../b", "./a", "a\\b", ""])
def test_names_beyond_the_bounds_or_not_plain_are_refused(tmp_path, name):
    with pytest.raises(CheckpointError, match="refusing file name") as raised:
        check_file_name(str(tmp_path), name)
    assert MANIFEST in str(raised.value)


@pytest.mark.parametrize("name", ["model_0.safetensors", "sharded.orbax/ocdbt.process_12/d/" + "f" * 32,
                                  "sharded.orbax/a0/c/0/0/0/0", "/".join(["p"] * 16), "a" * 255,
                                  "/".join(["q" * 255] * 16)])
def test_names_within_the_bounds_are_accepted(tmp_path, name):
    assert check_file_name(str(tmp_path), name) == os.path.join(str(tmp_path), *name.split("/"))


def test_a_link_on_the_way_to_a_listed_file_is_refused(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "sharded.orbax").symlink_to(tmp_path / "outside")
    with pytest.raises(CheckpointError, match="link inside the checkpoint"):
        check_file_name(str(tmp_path / "ckpt"), "sharded.orbax/d/x")


# -- finding 3: special files are refused before any open that can block --------------------------

def _finishes(seconds: float, fn: Callable[[], Any], fifo: str) -> Any:
    """``fn()``'s result or exception; fails the test (after unblocking it) if it hangs."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except Exception as err:  # noqa: BLE001
            box["result"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():  # a reader blocked in open(): give it a writer, then EOF
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(5)
        pytest.fail(f"hung for {seconds}s on the FIFO {fifo}")
    return box["result"]


def test_a_fifo_manifest_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / MANIFEST)
    outcome = _finishes(5, lambda: read_manifest(str(tmp_path)), str(tmp_path / MANIFEST))
    assert isinstance(outcome, CheckpointError), outcome
    assert str(tmp_path / MANIFEST) in str(outcome) and "not a regular file (a FIFO)" in str(outcome)


@pytest.mark.parametrize("reader", ["read", "verify_file"])
def test_a_fifo_data_file_is_refused_without_blocking(tmp_path, reader):
    path = str(tmp_path / "model_0.safetensors")
    os.mkfifo(path)
    outcome = _finishes(5, lambda: getattr(safetensors_io, reader)(path, 16, "0" * 16), path)
    assert isinstance(outcome, CheckpointError), outcome
    assert path in str(outcome) and "not a regular file (a FIFO)" in str(outcome)


def test_save_state_does_not_block_on_a_fifo_manifest_in_its_target(tmp_path):
    """save_state(dir) reads dir's manifest to see whether dir is a checkpoint it may replace."""
    os.mkfifo(tmp_path / MANIFEST)
    outcome = _finishes(5, lambda: layout.foreign_entries(str(tmp_path)), str(tmp_path / MANIFEST))
    assert outcome == [MANIFEST]  # not a checkpoint's manifest: the directory is not replaced


def _make_directory(path: str) -> str:
    os.mkdir(path)
    return "a directory"


def _make_socket(path: str) -> str:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.close()
    return "a socket"


def _make_symlink(path: str) -> str:
    target = path + ".target"
    _write(target, _safetensors(b"{}      "))
    os.symlink(target, path)
    return "a symbolic link"


def _make_device(path: str) -> str:
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
    except (PermissionError, OSError) as err:
        pytest.skip(f"cannot create a device node here ({err})")
    return "a character device"


@pytest.mark.parametrize("make", [_make_directory, _make_socket, _make_symlink, _make_device])
@pytest.mark.parametrize("reader", ["read", "verify_file", "manifest"])
def test_special_files_are_refused_and_named(tmp_path, make, reader):
    path = str(tmp_path / (MANIFEST if reader == "manifest" else "x.safetensors"))
    kind = make(path)
    size = os.lstat(path).st_size
    with pytest.raises(CheckpointError) as raised:
        if reader == "manifest":
            read_manifest(str(tmp_path))
        else:
            getattr(safetensors_io, reader)(path, size, "0" * 16)
    assert path in str(raised.value) and f"not a regular file ({kind})" in str(raised.value)


# -- finding 5: bounded headers and manifests, parsed within a small multiple of their size --------

def test_a_header_beyond_the_cap_is_refused_before_parsing():
    cap = getattr(safetensors_io, "MAX_HEADER_BYTES", 64 << 20)
    header = b"{}" + b" " * (cap - 1)
    buffer = _safetensors(header)
    peak, outcome = peak_of(lambda: safetensors_io.parse(buffer, "big.safetensors"))
    assert isinstance(outcome, CheckpointError) and "big.safetensors" in str(outcome), outcome
    assert "header" in str(outcome) and str(cap) in str(outcome)
    assert peak < 1 << 20  # nothing was copied or parsed


def test_a_manifest_beyond_the_cap_is_refused_before_reading(tmp_path):
    with open(tmp_path / MANIFEST, "wb") as handle:
        handle.truncate((64 << 20) + 1)
    peak, outcome = peak_of(lambda: read_manifest(str(tmp_path)))
    assert isinstance(outcome, CheckpointError) and "larger than" in str(outcome), outcome
    assert peak < 1 << 20


_SIZE = 1 << 20
# JSON shapes that cost the most memory per byte, as a safetensors header or as a manifest.
_HOSTILE = {
    "empty lists": lambda: b'{"a":[' + b"[]," * (_SIZE // 3) + b"[]]}",
    "empty dicts": lambda: b'{"a":[' + b"{}," * (_SIZE // 3) + b"{}]}",
    "small dicts": lambda: b'{"a":[' + b'{"":0},' * (_SIZE // 7) + b"{}]}",
    "distinct keys": lambda: b'{"a":{' + b",".join(b'"%d":0' % i for i in range(_SIZE // 9)) + b"}}",
    "keys of empty dicts": lambda: b"{" + b",".join(b'"%d":{}' % i for i in range(_SIZE // 9)) + b"}",
    "short strings": lambda: b'{"a":[' + b",".join(b'"%02x"' % (i % 256) for i in range(_SIZE // 5)) + b"]}",
    "floats": lambda: b'{"a":[' + b"1.5," * (_SIZE // 4) + b"1]}",
    "ints": lambda: b'{"a":[' + b"300," * (_SIZE // 4) + b"1]}",
    "a wide string": lambda: b'{"a":"' + b"a" * _SIZE + b'\\ud83d\\ude00"}',
    "deep": lambda: b"[" * _SIZE + b"]" * _SIZE,
    "tiny valid entries": lambda: json.dumps(
        {str(i): {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(_SIZE // 50)},
        separators=(",", ":")).encode(),
    "shape lists": lambda: b'{"a":{"dtype":"U8","shape":[' + b"300," * (_SIZE // 4) + b'0],"data_offsets":[0,0]}}',
    "metadata": lambda: b'{"__metadata__":{' + b",".join(b'"%d":""' % i for i in range(_SIZE // 9)) + b"}}",
}


@pytest.mark.parametrize("shape", sorted(_HOSTILE))
def test_memory_of_parsing_a_hostile_header_is_bounded(shape):
    header = _HOSTILE[shape]()
    header += b" " * (-len(header) % 8)
    buffer = _safetensors(header)
    peak, outcome = peak_of(lambda: safetensors_io.parse(buffer, "h.safetensors"))
    assert isinstance(outcome, (CheckpointError, dict)), outcome
    assert peak <= HEADER_PARSE_RATIO * len(header), f"{peak / len(header):.1f}x the header"


@pytest.mark.parametrize("shape", sorted(_HOSTILE))
def test_memory_of_parsing_a_hostile_manifest_is_bounded(tmp_path, shape):
    raw = _HOSTILE[shape]()
    (tmp_path / MANIFEST).write_bytes(raw)
    peak, outcome = peak_of(lambda: read_manifest(str(tmp_path)))
    assert isinstance(outcome, CheckpointError), outcome
    assert peak <= MANIFEST_PARSE_RATIO * len(raw), f"{peak / len(raw):.1f}x the manifest"


@pytest.mark.parametrize("names", [["0", "\U00010000"], ["\u5c42"], ["a" * 200]])
def test_small_manifests_with_wide_names_are_accepted(tmp_path, names):
    """A small manifest's estimate is high per byte (one non-ASCII escape widens every string in
    it): below a fixed allowance the ratio does not apply."""
    write_manifest(str(tmp_path), _body({n: {"size": 1, "xxh3": "0" * 16} for n in names if n.isascii()},
                                        structures={"custom_checkpoint_0": {n: 1 for n in names}}))
    assert read_manifest(str(tmp_path))["structures"]["custom_checkpoint_0"] == {n: 1 for n in names}


def _writer_header(count: int, name: str) -> bytes:
    """The header unified's writer produces for ``count`` float32 matrices."""
    arrays = {name.format(i): ("F32", (0, 4096), np.zeros(0, np.uint8)) for i in range(count)}
    path = f"/tmp/_unified_header_{os.getpid()}.safetensors"
    try:
        safetensors_io.write(path, arrays)
        with open(path, "rb") as handle:
            raw = handle.read()
    finally:
        os.remove(path)
    (length,) = struct.unpack_from("<Q", raw)
    return raw[8:8 + length]


@pytest.mark.parametrize("name", ["m/{}", "optimizer_0/state/{}/exp_avg_sq"])
def test_headers_our_writer_produces_parse_within_the_bound(name):
    header = _writer_header(20000, name)
    buffer = _safetensors(header)
    peak, outcome = peak_of(lambda: safetensors_io.parse(buffer, "h.safetensors"))
    assert isinstance(outcome, dict) and len(outcome) == 20000, outcome
    assert peak <= HEADER_PARSE_RATIO * len(header), f"{peak / len(header):.1f}x the header"


def test_manifests_our_writer_produces_parse_within_the_bound(tmp_path):
    state = {"state": {i: {"exp_avg": np.zeros(1), "step": np.float32(i)} for i in range(3000)},
             "param_groups": [{"params": list(range(3000)), "lr": 0.1}]}
    structure, arrays = codec.encode(state, lambda x: False, "optimizer_0")
    files = {f"rng_{i}.safetensors": {"size": 100, "xxh3": "0" * 16} for i in range(500)}
    write_manifest(str(tmp_path), _body(files, structures={"optimizer_0": structure}, objects=["optimizer_0"]))
    size = os.path.getsize(tmp_path / MANIFEST)
    peak, outcome = peak_of(lambda: read_manifest(str(tmp_path)))
    assert isinstance(outcome, dict), outcome
    assert peak <= MANIFEST_PARSE_RATIO * size, f"{peak / size:.1f}x the manifest"


# -- finding 6: only CheckpointError escapes the readers -------------------------------------------

scalars = st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=16)
wrong = json_values | st.sampled_from([-1, 2**64, 10**30, -10**30, 1.5, "7", True, None, [], {}, [1, 2, 3]])


def _check_accepted_types(manifest: Dict[str, Any]) -> None:
    """What read_manifest accepts has the types the loader relies on."""
    assert isinstance(manifest["files"], dict) and isinstance(manifest["structures"], dict)
    assert isinstance(manifest["sharded"], dict) and isinstance(manifest["objects"], list)
    assert all(type(i["size"]) is int and i["size"] >= 0 for i in manifest["files"].values())
    assert type(manifest["num_processes"]) is int and type(manifest["iteration"]) is int


@SETTINGS
@given(field=st.sampled_from(["files", "structures", "objects", "sharded", "backend", "num_processes",
                              "iteration", "format_version"]), value=wrong)
def test_signed_manifests_with_hostile_fields_raise_only_checkpoint_errors(tmp_path_factory, field, value):
    directory = str(tmp_path_factory.mktemp("m"))
    _signed(directory, {**_body({"model_0.safetensors": {"size": 1, "xxh3": "0" * 16}}), field: value})
    _read_refused_or_well_typed(directory)


@SETTINGS
@given(entry=st.dictionaries(st.sampled_from(["size", "xxh3", "other"]), wrong | st.just("0" * 16), max_size=3),
       name=st.sampled_from(["model_0.safetensors", "a/b", "../x"]) | st.text(max_size=8))
def test_signed_manifests_with_hostile_file_entries_raise_only_checkpoint_errors(tmp_path_factory, entry, name):
    directory = str(tmp_path_factory.mktemp("m"))
    _signed(directory, _body({name: entry}))
    _read_refused_or_well_typed(directory)


def _read_refused_or_well_typed(directory: str) -> None:
    """Reading a hostile manifest raises a CheckpointError naming it, or gives well-typed fields."""
    try:
        manifest = read_manifest(directory)
    except CheckpointError as err:
        assert MANIFEST in str(err)
    else:
        _check_accepted_types(manifest)


@SETTINGS
@given(raw=st.sampled_from([b"[" * 100000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b"1" * 5000, b"1e999999",
                            b'{"a":1,"a":2}', b"\xff\xfe", b'"\\ud800"', b"NaN", b"[]", b'{"manifest_xxh3":[]}'])
       | st.binary(max_size=200))
def test_hostile_manifest_bytes_raise_only_checkpoint_errors(tmp_path_factory, raw):
    directory = str(tmp_path_factory.mktemp("m"))
    with open(os.path.join(directory, MANIFEST), "wb") as handle:
        handle.write(raw)
    with pytest.raises(CheckpointError, match=MANIFEST):
        read_manifest(directory)


@pytest.mark.parametrize("levels", [200, 900, 5000])
def test_nesting_hidden_by_brackets_in_strings_is_still_refused(tmp_path, levels):
    """A string of "]" hides nesting from the count made before parsing (and a long string keeps
    the cost estimate low): json.loads' own guard, or codec.decode's bound, refuses it."""
    deep = "[" * levels + "1" + "]" * levels
    body = ('{"backend": "torch", "files": {}, "format": "unified-checkpoint", "format_version": 1, "iteration": 0, '
            '"num_processes": 1, "objects": ["model_0"], "pad": "' + "x" * 10 * levels + '", "sharded": {}, '
            '"structures": {"model_0": {"hidden": "' + "]" * levels + '", "deep": ' + deep + "}}}")
    try:
        digest = xxhash.xxh3_64_hexdigest(json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode())
    except RecursionError:
        digest = "0" * 16
    (tmp_path / MANIFEST).write_text(body[:-1] + f', "manifest_xxh3": "{digest}"}}')
    with pytest.raises(CheckpointError):
        manifest = read_manifest(str(tmp_path))
        codec.decode(manifest["structures"]["model_0"], {}, lambda a: a)


def test_an_unknown_dtype_is_refused_naming_the_file():
    header = json.dumps({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}).encode()
    with pytest.raises(CheckpointError, match=r"h\.safetensors: .*unknown dtype 'X9'"):
        safetensors_io.parse(_safetensors(header, b"\0"), "h.safetensors")


def _info(dtype: Any = "F32", shape: Any = (2,), offsets: Any = (0, 8)) -> Dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


header_values = st.one_of(
    st.builds(_info, dtype=wrong | st.sampled_from(["F32", "BF16", "U8", "F8_E4M3", "X"]),
              shape=st.lists(st.integers(-3, 3) | st.sampled_from([2**63, 2**64, 10**40, 0]), max_size=70) | wrong,
              offsets=st.lists(st.integers(-10, 20) | st.sampled_from([2**63, 2**64]), max_size=3) | wrong),
    st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), wrong, max_size=4),
    wrong,
)


@SETTINGS
@given(entries=st.dictionaries(st.text(max_size=5) | st.just("__metadata__"), header_values, max_size=4),
       data=st.binary(max_size=24), top=st.none() | json_values)
def test_hostile_headers_raise_only_checkpoint_errors(entries, data, top):
    header = json.dumps(entries if top is None else top).encode()
    try:
        arrays = safetensors_io.parse(_safetensors(header, data), "h.safetensors")
    except CheckpointError as err:
        assert "h.safetensors" in str(err)
    else:
        for array in arrays.values():
            assert isinstance(array, np.ndarray) and array.nbytes <= len(data)


@SETTINGS
@given(raw=st.binary(max_size=64), length=st.integers(0, 2**64 - 1) | st.integers(0, 80))
def test_hostile_header_bytes_raise_only_checkpoint_errors(raw, length):
    buffer = struct.pack("<Q", length) + raw
    try:
        safetensors_io.parse(buffer, "h.safetensors")
    except CheckpointError as err:
        assert "h.safetensors" in str(err)


def test_a_truncated_file_raises_a_checkpoint_error(tmp_path):
    for content in (b"", b"\x01", b"\x10\x00\x00\x00\x00\x00\x00\x00{}"):
        path = str(tmp_path / "t.safetensors")
        info = _write(path, content)
        with pytest.raises(CheckpointError, match="t.safetensors"):
            safetensors_io.read(path, info["size"], info["xxh3"])


special_nodes = st.one_of(
    st.fixed_dictionaries({"__array__": wrong | st.sampled_from(["a", "missing"]), "kind": wrong}),
    st.fixed_dictionaries({
        "__numpy_scalar__": wrong | st.sampled_from(["<f4", "<i8", "|V2", "(99999999999,)f8", "O", "U3"]),
        "value": wrong}),
    st.fixed_dictionaries({"__float__": wrong | st.sampled_from(["nan", "inf", "x"])}),
    st.fixed_dictionaries({"__tuple__": wrong}),
    st.fixed_dictionaries({"__dict__": wrong | st.lists(st.lists(wrong, max_size=3), max_size=3)}),
)
structures = st.recursive(scalars | special_nodes, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=10)


@SETTINGS
@given(structure=structures)
def test_hostile_structures_raise_only_checkpoint_errors(structure):
    try:
        codec.decode(structure, {"a": np.zeros(2)}, lambda a: a)
    except CheckpointError:
        pass


@pytest.mark.parametrize("depth", [codec.MAX_DEPTH + 1, 5000] if hasattr(codec, "MAX_DEPTH") else [5000])
def test_deeply_nested_structures_are_refused_by_decode_and_encode(depth):
    deep: Any = 1
    for _ in range(depth):
        deep = [deep]
    with pytest.raises(CheckpointError, match="deep"):
        codec.decode(deep, {}, lambda a: a)
    with pytest.raises(TypeError, match="deep"):
        codec.encode(deep, lambda x: False, "obj")


def test_a_container_that_contains_itself_is_refused_at_save():
    loop: list = []
    loop.append(loop)
    with pytest.raises(TypeError, match="deep"):
        codec.encode({"x": loop}, lambda x: False, "obj")


def test_encode_accepts_what_decode_accepts_up_to_the_bound():
    deep: Any = np.zeros(1)
    for _ in range(codec.MAX_DEPTH - 1):
        deep = [deep]
    structure, arrays = codec.encode(deep, lambda x: False, "obj")
    assert codec.decode(structure, arrays, lambda a: a) is not None


def test_arrays_of_every_size_still_round_trip(tmp_path):
    arrays = {f"a/{i}": np.arange(n, dtype=np.float32).reshape(-1, 1) for i, n in enumerate((0, 1, 5))}
    exported = {k: safetensors_io.export_numpy(v) for k, v in arrays.items()}
    info = safetensors_io.write(str(tmp_path / "f.safetensors"), exported)
    back = safetensors_io.read(str(tmp_path / "f.safetensors"), info["size"], info["xxh3"])
    assert {k: v.tolist() for k, v in back.items()} == {k: v.tolist() for k, v in arrays.items()}
    assert math.prod(back["a/2"].shape) == 5 and back["a/2"].flags.writeable  # private memory (finding 4)


@pytest.mark.parametrize("count,requests", [(3, 1), (3000, 2)])
def test_a_header_is_read_in_one_request_unless_it_is_long(tmp_path, count, requests):
    """Describing a file from its header (a store's object: each request costs its latency) asks
    once for a header that fits the first read, twice for a longer one (here 3000 arrays,
    ~180 kB); before, always twice (its length, then the header). The result is the same."""
    path = str(tmp_path / "f.safetensors")
    arrays = {f"a{i}": np.full(4, i, np.float32) for i in range(count)}
    safetensors_io.write(path, {k: safetensors_io.export_numpy(v) for k, v in arrays.items()})
    size, calls = os.path.getsize(path), []

    def read_at(at, n):
        calls.append((at, n))
        with open(path, "rb") as handle:
            return os.pread(handle.fileno(), n, at)

    start, entries, _ = safetensors_io.header_of(read_at, path, size)
    assert len(calls) == requests
    assert sorted(entries) == sorted(arrays) and entries["a2"][:2] == ("F32", (4,))
    with open(path, "rb") as handle:
        data = os.pread(handle.fileno(), size, 0)
    begin, end = entries["a2"][2:]
    assert np.frombuffer(data[start + begin:start + end], np.float32).tolist() == [2.0] * 4


def test_the_headers_of_several_files_are_asked_for_at_once_and_failures_come_in_order(tmp_path):
    """`headers_of` (the sharded readers of both backends on a store): every file's first request
    is in flight together (the barrier lets them through only then; one by one it times out),
    and with two damaged files the first one's error is raised."""
    from unified.checkpoint.store import headers_of

    paths = []
    for i in range(4):
        paths.append(str(tmp_path / f"shard-{i}.safetensors"))
        safetensors_io.write(paths[-1], {"w": safetensors_io.export_numpy(np.full(8, i, np.float32))})
    together = threading.Barrier(len(paths), timeout=10)

    def read_range(path, start, end):
        if start == 0:
            together.wait()
        with open(path, "rb") as handle:
            return os.pread(handle.fileno(), end - start, start)

    got = headers_of(paths, os.path.getsize, read_range)
    assert [size for size, _ in got] == [os.path.getsize(p) for p in paths]
    assert all(entries["w"][:2] == ("F32", (8,)) for _, (_, entries, _) in got)
    for path in paths[1:3]:
        with open(path, "r+b") as handle:
            handle.write(struct.pack("<Q", 1 << 40))  # a header length beyond the file
    together.reset()
    with pytest.raises(CheckpointError) as caught:
        headers_of(paths, os.path.getsize, read_range)
    assert "shard-1.safetensors" in str(caught.value)
