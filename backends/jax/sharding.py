"""Where each array of a sharded NNX model or optimizer lives on the mesh (ZeRO-3 style).

The rule (docs/sharding.md, "JAX"): our mesh has one axis, ``"data"``, over every device of
every process. An array is split along one of its dimensions over that axis:

- a variable annotated with ``nnx.with_partitioning`` (its ``out_sharding`` metadata): whatever
  the annotation's axis names, the annotated dimensions (entries that are not ``None``) are the
  candidates; an annotation with no named dimension keeps the array replicated;
- any other array: every dimension is a candidate.

Of the candidates, the largest dimension whose size the number of devices divides is split
(the first of equal ones); the array stays replicated when none divides, when it is a scalar,
or when it is a PRNG key. Optimizer moments carry their parameter's annotation (flax copies
the metadata) or have its shape, so they follow their parameter.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import jax

AXIS = "data"

Path = Tuple[Any, ...]


def annotations(obj: Any) -> Dict[Path, Optional[Tuple[Any, ...]]]:
    """``path -> out_sharding`` of every variable of ``obj`` that has one (paths as in
    ``nnx.state(obj).to_pure_dict()``)."""
    from flax import nnx

    found: Dict[Path, Optional[Tuple[Any, ...]]] = {}
    for path, variable in nnx.to_flat_state(nnx.state(obj)):
        metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
        names = metadata.get("out_sharding") or metadata.get("sharding_names")
        if names is not None and not isinstance(names, jax.sharding.Sharding):
            found[tuple(path)] = tuple(names)
    return found


def split_dimension(shape: Sequence[int], devices: int, annotation: Optional[Tuple[Any, ...]] = None) -> Optional[int]:
    """The dimension to split ``shape`` along over ``devices`` devices, or ``None`` (replicated).

    Example:
        >>> split_dimension((6, 8), 2)
        1
        >>> split_dimension((6, 8), 3)
        0
        >>> split_dimension((6, 8), 2, annotation=("model", None))
        0
        >>> split_dimension((5,), 2) is None
        True
    """
    if devices <= 1 or not shape:
        return None
    candidates = range(len(shape)) if annotation is None else [
        d for d, name in enumerate(annotation[:len(shape)]) if name is not None]
    best = None
    for d in candidates:
        if shape[d] % devices == 0 and shape[d] >= devices and (best is None or shape[d] > shape[best]):
            best = d
    return best


def partition_spec(shape: Sequence[int], devices: int, annotation: Optional[Tuple[Any, ...]] = None) -> Any:
    """The ``PartitionSpec`` over our mesh's ``"data"`` axis that `split_dimension` chooses."""
    from jax.sharding import PartitionSpec

    dim = split_dimension(shape, devices, annotation)
    if dim is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * dim + [AXIS]))
