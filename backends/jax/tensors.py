"""JAX arrays to and from host memory: a whole copy on the host (`host_copy`), this process's own
value (`local_value`), a global array made from a host array (`place`), moved to another
sharding (`reshard`), and the checks they share. The bottom of the JAX backend, beside which
`core` keeps the Backend class.

Example:
    >>> host_copy(jax.numpy.ones(2))
    array([1., 1.], dtype=float32)
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from unified.errors import see

__all__ = ["check_like", "host_copy", "is_global", "is_key", "local_value", "place", "reshard", "shares_memory"]


def shares_memory(value: Any, host: np.ndarray) -> bool:
    """Whether a CPU buffer of ``value`` lies inside ``host``'s memory."""
    start, end = host.ctypes.data, host.ctypes.data + host.nbytes
    for shard in value.addressable_shards:
        if shard.device.platform == "cpu" and start <= shard.data.unsafe_buffer_pointer() < max(end, start + 1):
            return True
    return False


def check_like(host: Any, like: Any, path: str) -> None:
    """``host`` (a NumPy or JAX array) has ``like``'s dtype and shape (a typed key: any)."""
    if not is_key(like) and (tuple(host.shape) != tuple(like.shape) or host.dtype != like.dtype):
        raise ValueError(f"{path}: expected {like.dtype}{list(like.shape)}; "
                         f"the checkpoint has {host.dtype}{list(host.shape)}")


def is_global(value: Any) -> bool:
    """A `jax.Array` with parts on other processes (this process cannot copy it whole)."""
    return isinstance(value, jax.Array) and not value.is_fully_addressable


def reshard(value: Any, sharding: Any) -> Any:
    """``value`` moved to ``sharding`` on the devices, no host copy: `jax.device_put` for an array
    this process holds whole (nothing to compile), else a collective inside ``jit``."""
    if value.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.jit(lambda x: x, out_shardings=sharding)(value)


def is_key(value: Any) -> bool:
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def host_copy(value: Any) -> np.ndarray:
    """A NumPy copy of an array this process holds whole (typed PRNG keys as their key data)."""
    if is_key(value):
        value = jax.random.key_data(value)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        if not value.is_fully_replicated:
            raise TypeError(
                "an array sharded across processes cannot be saved by one process yet; keep the state "
                "replicated (accelerator.prepare does) or save it with Orbax." + see("sharded-array")
            )
        value = value.addressable_shards[0].data
    return np.asarray(jax.device_get(value))


def place(host: np.ndarray, like: Any, sharding: Any, path: str) -> Any:
    """``host`` as a global array with ``like``'s dtype (or key type) and the given sharding."""
    if is_key(like):
        data = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(like))
    check_like(host, like, path)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def local_value(value: Any) -> np.ndarray:
    """This process's own value of an array: a replicated global array's copy, or the rows of a
    global array that this process holds (a jitted step's outputs are global arrays), each once
    (a process may hold several devices with the same rows: a tensor-parallel group's)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        if value.is_fully_replicated:
            return np.asarray(value.addressable_shards[0].data)
        distinct = {}
        for shard in value.addressable_shards:
            start = (shard.index[0].start or 0) if shard.index else 0
            distinct.setdefault(start, shard)
        return np.concatenate([np.asarray(distinct[start].data) for start in sorted(distinct)])
    return np.asarray(value)
