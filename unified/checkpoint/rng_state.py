"""RNG state in a checkpoint: each process's streams are saved (``rng_{rank}``); a load checks
them before anything is restored and, when the process count changed, derives the streams of
processes that did not exist (`resolve_rng`, `derived_rng_seed`).
"""
from __future__ import annotations

import json
import os
import random
import warnings
import zlib
from typing import Any, Dict, List

import numpy as np

from ..errors import CheckpointError, see
from ..runtime.rng import restore_host_rng
from . import codec
from .agreement import Agreement

HOST_GENERATORS = ("python", "numpy")


def _same_state(a: Any, b: Any) -> bool:
    """Whether two decoded generator states are equal (NumPy arrays by dtype, shape and value)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _state_bytes(value: Any) -> bytes:
    """A canonical byte form of a decoded generator state (for `derived_rng_seed`)."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype.str}{list(value.shape)}".encode() + np.ascontiguousarray(value).tobytes()
    if isinstance(value, dict):
        return b"{" + b",".join(json.dumps(k).encode() + b":" + _state_bytes(value[k]) for k in sorted(value)) + b"}"
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(_state_bytes(v) for v in value) + b"]"
    return json.dumps(value, default=repr).encode()


def derived_rng_seed(generator: str, process_index: int, saved_processes: int, template: Any) -> int:
    """The seed of ``generator`` on a process that did not exist in the saving run
    (``process_index >= saved_processes``): a 32-bit value of NumPy's ``SeedSequence`` over the
    generator's name, the process index, the saving run's process count and the saved state of
    the same generator on process ``process_index % saved_processes`` (``template``). The same
    checkpoint resumed with the same count gives the same streams; different processes, generators
    and checkpoints give unrelated ones.

    Example:
        >>> derived_rng_seed("python", 2, 2, {"state": [1, 2, 3]}) == derived_rng_seed(
        ...     "python", 2, 2, {"state": [1, 2, 3]})
        True
    """
    entropy = [zlib.crc32(f"unified-rng/{generator}".encode()), int(process_index), int(saved_processes),
               zlib.crc32(_state_bytes(template))]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def resolve_rng(streams: List[Dict[str, Any]], process_index: int) -> Dict[str, Any]:
    """The random streams of process ``process_index`` from every saving process's ``streams``
    (``{"host": {"python", "numpy"}, "framework": {name: state}}``), when the count changed.

    Per generator (Python's ``random``, NumPy's global generator, each framework generator):
    a generator in the same state on every saving process (seeded alike, as ``Accelerator(seed=)``
    and ``set_seed(seed)`` do; the JAX key stream) gets that state on every process; otherwise
    process ``i`` below the saving count gets process ``i``'s saved state, and a process that
    did not exist gets the generator seeded with `derived_rng_seed`.

    Returns ``{"host", "framework"}`` states to restore, ``"derived"`` (generator -> seed, for
    this process) and ``"differing"`` (generators whose saved states differed between processes).
    """
    saved = len(streams)
    names = list(HOST_GENERATORS) + sorted(set.intersection(*(set(s["framework"]) for s in streams)))

    def state_of(stream: Dict[str, Any], name: str) -> Any:
        return stream["host"][name] if name in HOST_GENERATORS else stream["framework"][name]

    mine = streams[process_index] if process_index < saved else streams[process_index % saved]
    host, framework = dict(mine["host"]), dict(mine["framework"])
    derived: Dict[str, int] = {}
    differing = []
    for name in names:
        values = [state_of(s, name) for s in streams]
        if all(_same_state(values[0], v) for v in values[1:]):
            value = values[0]
        else:
            differing.append(name)
            value = values[process_index % saved]
            if process_index >= saved:
                derived[name] = derived_rng_seed(name, process_index, saved, value)
        (host if name in HOST_GENERATORS else framework)[name] = value
    return {"host": host, "framework": framework, "derived": derived, "differing": differing}


class RngState(Agreement):
    """Checking, choosing and restoring RNG streams at load (mixed into `CheckpointManager`)."""

    def _check_rng(self, rng: Any, where: str) -> None:
        """Refuse, before anything is restored, RNG state that lacks a generator this run has:
        a resume that silently skipped one would diverge without a word."""
        framework = rng.get("framework") if isinstance(rng, dict) else None
        host = rng.get("host") if isinstance(rng, dict) else None
        missing = [] if isinstance(host, dict) and {"python", "numpy"} <= set(host) else ["Python/NumPy"]
        current = self.backend.rng_state()
        saved = set(framework if isinstance(framework, dict) else ())
        missing += sorted(set(current) - saved - set(self.backend.optional_rng_state))
        if missing:
            raise CheckpointError(f"{where}: has no state for the random generator(s) {', '.join(missing)} of this "
                                  "run; refusing to resume without it." + see("rng-restore"))
        for name, value in current.items():
            if name not in framework:  # an optional one (`Backend.optional_rng_state`)
                continue
            saved = framework[name]
            if not (isinstance(saved, np.ndarray) and saved.dtype == np.asarray(value).dtype
                    and saved.shape == np.shape(value)):
                raise CheckpointError(f"{where}: the state of generator {name!r} does not fit this run's "
                                      "(another dtype or size)." + see("rng-restore"))
        scratch_random, scratch_numpy = random.getstate(), np.random.get_state()
        try:  # the host generators refuse a malformed state here, before anything is restored
            restore_host_rng(host)
        except (TypeError, ValueError, KeyError, OverflowError) as err:
            raise CheckpointError(f"{where}: malformed Python/NumPy generator state ({err})."
                                  + see("rng-restore")) from err
        finally:
            random.setstate(scratch_random)
            np.random.set_state(scratch_numpy)

    def _restore_rng(self, rng: Dict[str, Any], manifest: Dict[str, Any]) -> None:
        """Restore this process's streams as `resolve_rng` chose them; a derived stream is the
        generator seeded with its derived seed (framework generators through `Backend.seed`)."""
        derived: Dict[str, int] = rng["derived"]
        framework = dict(rng["framework"])
        for name in sorted(set(derived) - {"python", "numpy"}):
            self.backend.seed(derived[name])
            framework[name] = np.array(self.backend.rng_state()[name], copy=True)
        restore_host_rng(rng["host"])
        if "python" in derived:
            random.seed(derived["python"])
        if "numpy" in derived:
            np.random.seed(derived["numpy"])
        self.backend.set_rng_state(framework)
        saved, count = manifest.get("num_processes"), self.backend.num_processes
        if count > saved and self.backend.process_index == 0 and rng["differing"]:
            warnings.warn(
                f"Checkpoint saved by {saved} processes, loaded by {count}: processes {saved} to {count - 1} had no "
                f"saved state for the random generator(s) {', '.join(rng['differing'])}, which differed between the "
                "saving processes; theirs were derived from the checkpoint (processes below "
                f"{saved} continue their own streams)." + see("rng-rederived"),
                stacklevel=3,
            )

    def _read_rng(self, directory: str, manifest: Dict[str, Any], saved: int) -> Dict[str, Any]:
        """This process's streams from a verified manifest saved by ``saved`` processes, checked
        (`_check_rng`): with the same count its own; with another, chosen from every saving
        process's (`resolve_rng`). Read before anything is restored."""
        where, structures = os.path.join(directory, "manifest.json"), manifest.get("structures")
        rank = self.backend.process_index
        # The same count: this process's own streams. Another: every saving process's (see resolve_rng).
        ranks = [rank] if saved == self.backend.num_processes else range(saved)
        streams = []
        for r in ranks:
            name = f"rng_{r}"
            if name not in structures:
                raise CheckpointError(f"{where}: has no RNG state for process {r}; refusing to resume without it."
                                      + see("no-rng-state"))
            state = codec.decode(structures[name], self._read_file(directory, manifest, f"{name}.safetensors"),
                                 lambda a: a)
            self._check_rng(state, os.path.join(directory, f"{name}.safetensors"))
            streams.append(state)
        if saved == self.backend.num_processes:
            return {**streams[0], "derived": {}, "differing": []}
        return resolve_rng(streams, rank)
