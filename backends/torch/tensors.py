"""Tensors to and from the bytes of a checkpoint: torch's dtypes as safetensors names them, a
tensor's bytes as a NumPy view (`export_tensor`), and a tensor over a NumPy array's memory
(`tensor_from_numpy`). The bottom of the torch backend: every other module of it may use these.

Example:
    >>> export_tensor(torch.ones(2))[:2]
    ('F32', (2,))
"""
from __future__ import annotations

import warnings
from typing import Any, Tuple

import numpy as np
import torch

from unified.checkpoint.safetensors_io import DTYPE_NAMES
from unified.errors import see

__all__ = ["SAFETENSORS_DTYPES", "export_contiguous", "export_tensor", "storable", "tensor_from_numpy", "whole_local"]


def whole_local(tensor: Any) -> Any:
    """``tensor`` itself; for a DTensor that every process holds whole (``Replicate`` only; a
    split one is saved through the sharded format), its local tensor."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return tensor
    if all(type(p).__name__ == "Replicate" for p in placements):
        return tensor.to_local()
    raise TypeError(f"a DTensor with placements {tuple(map(str, placements))} cannot be saved: one with a Partial "
                    "placement is a sum not yet reduced; call .redistribute(placements=[Replicate()]) or "
                    ".full_tensor() first." + see("dtype-not-storable"))


def storable(dtype: Any) -> str:
    """The safetensors name of ``dtype``; a `TypeError` for one safetensors cannot hold."""
    if dtype not in SAFETENSORS_DTYPES:
        raise TypeError(f"tensors of dtype {dtype} cannot be stored in safetensors." + see("dtype-not-storable"))
    return SAFETENSORS_DTYPES[dtype]


def export_contiguous(host: torch.Tensor) -> Tuple[str, Tuple[int, ...], np.ndarray]:
    """`export_tensor`'s triple over a contiguous CPU tensor's own memory."""
    raw = host.reshape(-1).view(torch.uint8).numpy() if host.numel() else np.empty(0, np.uint8)
    return storable(host.dtype), tuple(host.shape), raw


def export_tensor(value: Any) -> Tuple[str, Tuple[int, ...], np.ndarray]:
    """(safetensors dtype, shape, uint8 NumPy view of the bytes) of a tensor: a view of the
    tensor's own memory when it is a contiguous CPU tensor, else of a contiguous CPU copy."""
    tensor = whole_local(value.detach())
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return export_contiguous(tensor.contiguous())


def tensor_from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        bits = _VIA_BITS.get(array.dtype.name)  # ml_dtypes types torch.from_numpy does not know
        if bits is not None:
            return torch.from_numpy(array.view(bits)).view(getattr(torch, array.dtype.name))
        return torch.from_numpy(array)


_VIA_BITS = {"bfloat16": np.int16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


# torch dtype -> safetensors name, for the dtypes torch and the format share
SAFETENSORS_DTYPES = {getattr(torch, numpy_name): name for name, numpy_name in DTYPE_NAMES.items()
                       if isinstance(getattr(torch, numpy_name, None), torch.dtype)}
