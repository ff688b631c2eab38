"""JAX's sharded state: where each array of a sharded NNX model or optimizer lives on the mesh
(ZeRO-3 style), and `JaxSharding`, mixed into `JaxBackend`, which saves and loads sharded arrays
through the storage of `backends.jax.storage`: with Orbax in a folder, as one safetensors file
per process on an object store.

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

import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax

from unified.backend import FileHashes, ShardedArrays, ShardedLoad, ShardedRead, ShardedTraining, ShardedWrite
from unified.config import is_url

__all__ = ["AXIS", "JaxSharding", "annotations", "partition_spec", "split_dimension"]

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


class JaxSharding(ShardedTraining, ShardedArrays):
    """What `unified.backend.ShardedTraining` and `ShardedArrays` ask of JAX, mixed into
    `JaxBackend`: the plugin that switches the rule above on (`JaxBackend.prepare` applies it) and
    sharded arrays in checkpoints, written and read by Orbax."""

    def configure_sharding(self, plugin: Any) -> None:
        """From now on `prepare` splits NNX parameters and optimizer state over the mesh
        (see `backends.jax.sharding` for the rule) instead of replicating them."""
        self._shard_plugin = plugin

    def is_sharded(self, value: Any) -> bool:
        return isinstance(value, jax.Array) and not value.is_fully_addressable and not value.is_fully_replicated

    # An object store gets the files of backends.jax.storage.write_shards (Orbax cannot write
    # there), read back hashed (load_sharded); a folder gets Orbax's, verified before
    # Orbax opens them (hashes_while_reading stays False: it is about folders).
    sharded_to_store = True

    def save_sharded(self, directory: str, arrays: Mapping[str, Any]) -> Optional[FileHashes]:
        """Every process writes its own shards: Orbax in a folder (the JAX way for multi-host
        state), one safetensors file per process on an object store (streamed from the arrays
        themselves: nothing changes them before this returns)."""
        if is_url(directory):
            return self._store_write(directory, arrays, copy=False).result()
        return self.begin_sharded_save(directory, arrays).result()

    def _store_write(self, directory: str, arrays: Mapping[str, Any], copy: bool) -> ShardedWrite:
        """The write of this process's pieces to a store (host copies of them first with ``copy``)."""
        from .storage import own_pieces, write_shards

        pieces, info = own_pieces(arrays, copy=copy)
        process = self.process_index
        return ShardedWrite(lambda: write_shards(directory, process, pieces, info))

    def begin_sharded_save(self, directory: str, arrays: Mapping[str, Any]) -> ShardedWrite:
        """The blocking part here (host copies of this process's shards; for Orbax also its
        folders and barriers); the returned write does the writes (for Orbax then the commit of
        process 0, ordered by barriers of the coordination service under keys of their own,
        never a device collective), bounded by the group's timeout."""
        if is_url(directory):  # the training goes on while the background uploads: host copies
            return self._store_write(directory, arrays, copy=True)
        import orbax.checkpoint as ocp

        from .storage import uncompressed_pytree_handler

        # Uncompressed chunks (Orbax's default is zstd): about 10% more bytes on disk for random
        # float32 weights, against 1.3x faster saves and 2x faster loads measured on 1.5 GB
        # (docs/benchmarks/checkpoint.md, "Sharded state"); the reader accepts both.
        checkpointer = ocp.AsyncCheckpointer(uncompressed_pytree_handler(ocp),
                                             async_options=ocp.AsyncOptions(timeout_secs=int(max(self._timeout, 1))))
        try:
            checkpointer.save(os.path.abspath(directory), args=ocp.args.PyTreeSave(dict(arrays)))
        except BaseException:
            checkpointer.close()
            raise

        def finish() -> None:
            try:
                checkpointer.wait_until_finished()
            finally:
                checkpointer.close()

        return ShardedWrite(finish)

    def load_sharded(self, directory: str, like: Mapping[str, Any], options: ShardedLoad) -> ShardedRead:
        """From an object store, or a folder that holds `write_shards`' files (a store's
        checkpoint copied to a folder): `backends.jax.storage.read_shards` (no collective), with
        the hashes of the files it read whole (into private local copies where
        ``options.copy_to`` gives one: those arrays come back deferred; in one pass,
        ``options.hash_when_placed``, those files are instead streamed once, with no copy, as the
        load makes their arrays, each handed to ``options.adopt_early``). Orbax's files from a
        folder, verified before: restored a group of arrays at a time (`OrbaxGroups`) as the load
        makes them with ``options.defer``, else at once."""
        from .storage import OrbaxGroups, holds_shard_files, read_shards

        if is_url(directory) or holds_shard_files(directory):
            one_pass = options.defer and options.hash_files and options.hash_when_placed
            if one_pass:  # the files read whole are streamed into place as the load makes their arrays
                read = read_shards(directory, like, stream_later=options.adopt_early or (lambda key, array: None))
                return ShardedRead(read.arrays, read.hashed, read.later, read.later_hashes)
            read = read_shards(directory, like, options.copy_to)
            return ShardedRead(read.arrays, read.hashed)
        if options.defer:
            return ShardedRead(OrbaxGroups(os.path.abspath(directory), like).deferred())
        import orbax.checkpoint as ocp

        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in like.items()}
        with ocp.StandardCheckpointer() as checkpointer:
            return ShardedRead(dict(checkpointer.restore(os.path.abspath(directory), target)))
