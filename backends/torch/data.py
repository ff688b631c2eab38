"""torch's loaders and batches, mixed into `TorchBackend`: ``prepare`` of a torch ``DataLoader``
(the adapter in `backends.common`, which a JAX run uses too) and the placement of each batch on
the process's device."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from backends.common import prepare_torch_loader
from unified.backend import ForeignLoaders
from unified.runtime.tree import flatten

from .tensors import tensor_from_numpy

__all__ = ["TorchData"]


class TorchData(ForeignLoaders):
    """What `unified.backend.ForeignLoaders` and ``Backend.place_batch`` ask of torch."""

    def prepare_loader(self, loader: Any, seed: Optional[int]) -> Any:
        return prepare_torch_loader(self, loader, seed)

    def place_batch(self, batch: Any) -> Any:
        leaves, rebuild = flatten(batch, lambda x: not isinstance(x, (dict, list, tuple)))
        placed = []
        for leaf in leaves:
            if isinstance(leaf, np.ndarray):
                leaf = tensor_from_numpy(leaf)
            placed.append(leaf.to(self._device, non_blocking=True) if isinstance(leaf, torch.Tensor) else leaf)
        return rebuild(placed)
