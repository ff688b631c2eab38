"""Python and NumPy global RNG state: capture, restore and seeding, written once for every backend."""
from __future__ import annotations

import random
import sys
from typing import Any, Dict

import numpy as np

from .environment import ProcessEnvironment

__all__ = ["set_seed", "capture_host_rng", "restore_host_rng"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False, backend: Any = None) -> None:
    """Seed Python's `random`, NumPy's global generator, the given backend and every registered
    framework that is already imported (none is imported for it; JAX has no global generator: the
    Accelerator's key stream is seeded by ``Accelerator(seed=...)``). As Accelerate's ``set_seed``
    seeds torch on every setup, a JAX run seeds torch too when the script imported it: a torch
    sampler built next (torchdata's ``RandomSampler`` seeds itself from torch's global generator)
    then draws the same order on every process.

    Example:
        >>> from unified.utils import set_seed
        >>> set_seed(42)
        >>> set_seed(42, device_specific=True)   # seed + process index
    """
    if device_specific:  # Accelerate's meaning: a different seed on every process
        seed += ProcessEnvironment.from_env().process_index
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if backend is not None:
        backend.seed(seed)
    from ..backend.registry import backend_names, backend_spec, load_object

    own = getattr(backend, "name", None)
    for name in backend_names():  # the backend's own framework was seeded above unless `deterministic` asks more
        spec = backend_spec(name)
        if spec.seed_globals and spec.framework in sys.modules and (name != own or deterministic):
            load_object(spec.seed_globals)(seed, deterministic)


def capture_host_rng() -> Dict[str, Any]:
    """Python and NumPy global generator states as JSON-ready values and NumPy arrays."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": np.asarray(keys, dtype=np.uint32),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def restore_host_rng(state: Dict[str, Any]) -> None:
    """Restore what `capture_host_rng` returned."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], np.asarray(npy["keys"], dtype=np.uint32), int(npy["pos"]),
         int(npy["has_gauss"]), float(npy["cached_gaussian"]))
    )
