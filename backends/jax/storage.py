"""The storage JAX's sharded state is written through: Orbax's own files, through its PyTree
handler with uncompressed chunks. Used by `backends.jax.sharding` (the save and load), as
torch's sharded state is written through its storage (backends/torch/storage.py)."""
from __future__ import annotations

import inspect
from typing import Any

__all__ = ["uncompressed_pytree_handler"]


def uncompressed_pytree_handler(ocp: Any) -> Any:
    """Orbax's PyTree handler without zstd where the installed Orbax offers the choice
    (``use_compression``, not in orbax-checkpoint 0.11.17); its default otherwise."""
    accepted = inspect.signature(ocp.PyTreeCheckpointHandler.__init__).parameters
    return ocp.PyTreeCheckpointHandler(**({"use_compression": False} if "use_compression" in accepted else {}))
