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

__all__ = ["JaxData"]


class JaxData(ForeignLoaders):
    """What `unified.backend.ForeignLoaders` and ``Backend.place_batch`` ask of JAX."""

    def prepare_loader(self, loader: Any, seed: Optional[int]) -> Any:
        if "torch" not in sys.modules:  # no torch imported: it cannot be a torch DataLoader
            return None
        return prepare_torch_loader(self, loader, seed)  # works here too, yielding jax.Arrays

    def place_batch(self, batch: Any) -> Any:
        """Global `jax.Array`s sharded over the processes along axis 0 (``"data"``)."""
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = NamedSharding(self.mesh, PartitionSpec("data"))
        return jax.tree_util.tree_map(
            lambda leaf: jax.make_array_from_process_local_data(sharding, np.asarray(_numpy_leaf(leaf))), batch
        )


def _numpy_leaf(value: Any) -> Any:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor from a torch DataLoader
        return value.detach().cpu().numpy()
    return value
