"""JAX's loaders and batches, mixed into `JaxBackend`: ``prepare`` of a torch ``DataLoader`` (the
adapter in `backends.common`, shared with the torch backend) and the placement of each batch as
global `jax.Array`s over the mesh."""
from __future__ import annotations

import sys
from typing import Any, Optional

import jax
import numpy as np

from backends.common import prepare_torch_loader
from unified.backend import ForeignLoaders
from unified.errors import see

__all__ = ["JaxData"]


class JaxData(ForeignLoaders):
    """What `unified.backend.ForeignLoaders` and ``Backend.place_batch`` ask of JAX."""

    def prepare_loader(self, loader: Any, seed: Optional[int]) -> Any:
        if "torch" not in sys.modules:  # no torch imported: it cannot be a torch DataLoader
            return None
        return prepare_torch_loader(self, loader, seed)  # works here too, yielding jax.Arrays

    def place_batch(self, batch: Any) -> Any:
        """Global `jax.Array`s sharded over the processes along axis 0 (``"data"``; with a
        `unified.ParallelismConfig`, over its data axes and replicated over ``tp``:
        `backends.jax.mesh`)."""
        sharding, ranks = self.data_sharding()
        held = getattr(self, "_ranks_held", 1)

        def place(leaf: Any) -> Any:
            local = np.asarray(_numpy_leaf(leaf))
            if held > 1 and local.ndim and local.shape[0] % held:
                raise ValueError(f"this process's devices hold {held} data-parallel ranks of the ParallelismConfig's "
                                 f"mesh, which split its batch evenly, but the batch has {local.shape[0]} rows: use "
                                 f"a batch_size that is a multiple of {held}." + see("parallelism-config"))
            shape = (local.shape[0] * ranks,) + local.shape[1:] if local.ndim else None
            return jax.make_array_from_process_local_data(sharding, local, shape)

        return jax.tree_util.tree_map(place, batch)


def _numpy_leaf(value: Any) -> Any:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor from a torch DataLoader
        return value.detach().cpu().numpy()
    return value
