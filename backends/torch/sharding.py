"""torch's sharded training: FSDP2 (``fully_shard``, DTensor parameters) and sharded checkpoints
through ``torch.distributed.checkpoint`` with its safetensors storage (no pickle anywhere).

Mixed into `TorchBackend`. The settings and every shared rule (manifest, verification, commit,
RNG, data positions) are `unified`'s; this module only holds the torch primitives:

- `shard_model`: ``fully_shard`` on the submodules the plugin's policy picks, then on the root,
  over a 1-D device mesh of every process; optimizers that hold the model's original parameters
  are re-pointed at the sharded ones (in either order of ``prepare``, as Accelerate does).
- model and optimizer state through ``torch.distributed.checkpoint.state_dict``
  (``get_*_state_dict`` / ``set_*_state_dict``): DTensor values keyed by parameter names, so a
  checkpoint reshards onto any number of processes.
- `save_sharded` / `load_sharded`: every process writes only its own shards through
  DCP's safetensors storage layout (one file per process, the offsets in its header; no
  ``.metadata`` pickle) and reads what it needs, both with the hashing storage of
  `backends.torch.storage` (checksums in the pass over the bytes). `begin_sharded_save` splits
  the write for async saves: DCP's staging (a host copy of the process's own shards) and the
  collective planning in the calling thread, the file writes alone in the background.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Dict, List, Mapping, Optional

import torch

from unified.backend import (
    DeferredArray,
    FileHashes,
    ShardedArrays,
    ShardedLoad,
    ShardedRead,
    ShardedTraining,
    ShardedWrite,
)
from unified.config import is_url
from unified.errors import CheckpointError, see

__all__ = ["TorchSharding"]

_MIXED = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _dtensor() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


class TorchSharding(ShardedTraining, ShardedArrays):
    """What `unified.backend.ShardedTraining` and `ShardedArrays` ask of torch."""

    sharded_format = "dcp"
    is_fsdp2 = True
    _fsdp_plugin: Optional[Any] = None

    def configure_sharding(self, plugin: Any) -> None:
        self._fsdp_plugin = plugin
        self._fsdp_mesh: Optional[Any] = None
        self._fsdp_models: List[Any] = []  # prepared models, sharded (or whole with one process)
        self._fsdp_optimizers: List[Any] = []  # the users' optimizers, as prepared
        # id(original parameter) -> (weak reference to it, the sharded parameter that replaced it)
        self._fsdp_swaps: Dict[int, Any] = {}

    @property
    def sharding_enabled(self) -> bool:
        return self._fsdp_plugin is not None

    # -- preparing ---------------------------------------------------------------------------------
    def _mesh_for_sharding(self) -> Any:
        """The mesh FSDP2 shards over: a `ParallelismConfig`'s ``dp_shard_cp`` (HSDP: with
        ``dp_replicate``, `backends.torch.mesh`), else a 1-D mesh of every process."""
        if self._fsdp_mesh is None:
            if getattr(self, "_parallel_config", None) is not None:
                return self.fsdp_mesh()
            from torch.distributed.device_mesh import init_device_mesh

            self._fsdp_mesh = init_device_mesh(self.device.type, (self.num_processes,))
        return self._fsdp_mesh

    def _wrap_targets(self, model: torch.nn.Module) -> List[torch.nn.Module]:
        """The submodules the plugin's policy gives their own shard group, children first."""
        plugin = self._fsdp_plugin
        policy = plugin.auto_wrap_policy
        if policy == "no_wrap":
            return []
        if callable(policy):
            pick = policy
        elif policy == "transformer_based_wrap":
            names = set(plugin.transformer_cls_names_to_wrap)
            found = {type(m).__name__ for m in model.modules()}
            unknown = sorted(names - found)
            if unknown:
                raise ValueError(f"transformer_cls_names_to_wrap names {', '.join(unknown)}, which no layer of this "
                                 f"model is (its classes: {', '.join(sorted(found)[:12])})." + see("fsdp-plugin"))
            pick = lambda m: type(m).__name__ in names  # noqa: E731
        else:  # size_based_wrap
            pick = lambda m: sum(p.numel() for p in m.parameters()) >= plugin.min_num_params  # noqa: E731
        return [m for m in reversed(list(model.modules())) if m is not model and pick(m)]

    def shard_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``fully_shard`` by the plugin's policy, then the root (with one process the model stays
        whole: there is nothing to shard over). Optimizers prepared before it are re-pointed."""
        if self.num_processes > 1 and not _is_fsdp(model):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            precision = _MIXED.get(self._loop.mixed_precision if getattr(self, "_loop", None) else "no")
            mesh = self._mesh_for_sharding()
            options = dict(mesh=mesh,
                           reshard_after_forward=self._fsdp_plugin.reshard_after_forward,
                           mp_policy=MixedPrecisionPolicy(param_dtype=precision, reduce_dtype=torch.float32)
                           if precision is not None else MixedPrecisionPolicy())
            before = dict(model.named_parameters())
            model = self.tensor_parallel(model)  # a ParallelismConfig's tp_size (backends.torch.mesh)
            if mesh is not None:  # None: tensor parallelism alone, nothing to shard over
                for module in self._wrap_targets(model):
                    fully_shard(module, **options)
                fully_shard(model, **options)
            after = dict(model.named_parameters())
            for name, old in before.items():
                if after.get(name) is not None and after[name] is not old:
                    self._fsdp_swaps[id(old)] = (weakref.ref(old), after[name])
            for optimizer in self._fsdp_optimizers:
                self._repoint(optimizer)
        self._fsdp_models.append(model)
        return model

    def sharded_optimizer(self, optimizer: Any) -> None:
        """Remember a prepared optimizer; point it at the sharded parameters (now, and when a
        model it trains is prepared after it)."""
        self._repoint(optimizer)
        self._fsdp_optimizers.append(optimizer)

    def _repoint(self, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                swap = self._fsdp_swaps.get(id(p))
                if swap is not None and swap[0]() is p:
                    if optimizer.state.get(p):
                        raise ValueError("this optimizer has already stepped on the model's unsharded parameters; "
                                         "prepare the model (and the optimizer) before the first optimizer step."
                                         + see("fsdp-optimizer"))
                    p = swap[1]
                params.append(p)
            group["params"] = params

    def _model_of(self, optimizer: Any) -> Optional[torch.nn.Module]:
        """The prepared model whose parameters ``optimizer`` trains."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in self._fsdp_models:
            if any(id(p) in ids for p in model.parameters()):
                return model
        return None

    # -- training loop -----------------------------------------------------------------------------
    def sharded_no_sync(self, model: Any) -> Any:
        """FSDP2's ``no_sync``: no reduce-scatter until the window closes."""
        if not _is_fsdp(model):
            return None

        @contextlib.contextmanager
        def no_sync() -> Any:
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return no_sync()

    def sharded_clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float) -> Optional[torch.Tensor]:
        """``clip_grad_norm_`` over DTensor gradients: the norm of the whole (sharded) gradient."""
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        if not any(isinstance(g, _dtensor()) for g in grads):
            return None
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(total, _dtensor()):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total

    def sharded_models_open_window(self) -> bool:
        return any(_is_fsdp(m) for m in self._fsdp_models)

    # -- state ---------------------------------------------------------------------------------------
    def sharded_state_of(self, kind: str, obj: Any) -> Optional[Any]:
        """Model/optimizer state through torch's distributed state-dict API (names as keys,
        DTensor values), or whole arrays with ``state_dict_type="FULL_STATE_DICT"``; ``None``
        for objects it does not handle."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = self._fsdp_plugin.state_dict_type == "FULL_STATE_DICT" and self.num_processes > 1
        if kind == "model":
            model = self.unwrap_model(obj)
            if not full:
                return get_model_state_dict(model)
            whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return whole if self.process_index == 0 else _placeholders(get_model_state_dict(model))
        if kind == "optimizer":
            inner = getattr(obj, "optimizer", obj)
            model = self._model_of(inner)
            if model is None:
                return None
            if not full:
                return get_optimizer_state_dict(model, inner)
            whole = get_optimizer_state_dict(model, inner,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return whole if self.process_index == 0 else _placeholders(get_optimizer_state_dict(model, inner))
        return None

    def sharded_load_state_into(self, kind: str, obj: Any, state: Any) -> bool:
        """Restore what `sharded_state_of` gave; False for objects it does not handle."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = self._fsdp_plugin.state_dict_type == "FULL_STATE_DICT" and self.num_processes > 1
        options = StateDictOptions(full_state_dict=full, strict=True)
        if kind == "model":
            model = self.unwrap_model(obj)
            if not full:  # whole arrays (saved replicated on another mesh) placed as this run's
                state = _placed_like(state, self.sharded_state_of(kind, obj))
            set_model_state_dict(model, state, options=options)
            return True
        if kind == "optimizer":
            inner = getattr(obj, "optimizer", obj)
            model = self._model_of(inner)
            if model is None:
                return False
            if not full:  # (its state made first, by a step that changes nothing: `_init_optim_state`)
                state = _placed_like(state, self.sharded_state_of(kind, obj))
            set_optimizer_state_dict(model, inner, state, options=options)
            return True
        return False

    def full_array(self, value: Any, key: str, timeout: float) -> Any:
        """A whole host copy of one array of a prepared model on every process: a DTensor is
        gathered with ``full_tensor()`` (a collective; `Accelerator.save_model` calls it on every
        process, one array at a time, so no process ever holds the whole model)."""
        if isinstance(value, _dtensor()):
            value = value.full_tensor()
        return self.to_numpy(value)

    # -- sharded arrays in checkpoints -------------------------------------------------------------
    def is_sharded(self, value: Any) -> bool:
        """A DTensor split across processes (FSDP2's parameters, or one the script built itself,
        e.g. for tensor parallelism): every process writes its own shards."""
        if not isinstance(value, _dtensor()):
            return False
        from torch.distributed.tensor import Shard

        return any(isinstance(p, Shard) for p in value.placements)

    def save_sharded(self, directory: str, arrays: Mapping[str, Any]) -> Optional[FileHashes]:
        """Every process writes its own shards: one safetensors file each (no pickle), hashed as
        it is written."""
        return self._plan_sharded_write(directory, arrays, stage=False).result()

    def begin_sharded_save(self, directory: str, arrays: Mapping[str, Any]) -> ShardedWrite:
        """`save_sharded` in two halves: here, a host copy of this process's own shards (DCP's
        staging) and the save plan agreed by every process (a collective); in the returned
        write, run in the background, only this process's file writes (no collective)."""
        return self._plan_sharded_write(directory, arrays, stage=True)

    def _plan_sharded_write(self, directory: str, arrays: Mapping[str, Any], stage: bool) -> ShardedWrite:
        """What ``torch.distributed.checkpoint.save`` does with ``HuggingFaceStorageWriter(
        save_distributed=True)``, with its planning (the collective) apart from its writes. That
        writer's ``finish`` writes nothing for a distributed save without consolidation, so the
        final all-reduce of ``dcp.save`` (which only hands ``finish`` the results) is left out:
        the checkpoint's manifest and commit are ours."""
        import torch.distributed as dist
        from torch.distributed.checkpoint import DefaultSavePlanner

        from .storage import HashingWriter

        writer = HashingWriter(directory)
        planner = DefaultSavePlanner()
        group = dist.is_available() and dist.is_initialized()
        rank, size = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
        local, failure = None, None
        try:
            # staging: DCP's own host copy (FileSystemWriter is an AsyncStager), new memory even on CPU
            state = writer.stage(dict(arrays)) if stage else dict(arrays)
            planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            local = writer.prepare_local_plan(planner.create_local_plan())
        except (OSError, RuntimeError, ValueError) as err:  # every process learns it below: none waits for a plan
            failure = f"process {rank}: {_first_line(err)}"
        plans = [(local, failure)]
        if size > 1:
            plans = [None] * size  # type: ignore[list-item]
            dist.all_gather_object(plans, (local, failure))
        failed = [reason for _, reason in plans if reason is not None]
        if failed:
            raise CheckpointError(f"{directory}: the sharded write could not be planned: {'; '.join(failed)}"
                                  + see("save-failed"))
        global_plans, _ = planner.create_global_plan([plan for plan, _ in plans])
        final = planner.finish_plan(writer.prepare_global_plan(global_plans)[rank])

        def write() -> FileHashes:
            writer.write_data(final, planner).wait()
            return writer.written

        return ShardedWrite(write)

    hashes_while_reading = True
    sharded_to_store = True  # HashingWriter / HashingReader stream to and from an object store
    # an array this run's object lacks (``like``: None) is read whole: a plain optimizer has no
    # state before its first step, and keys it by parameter index where DCP saved it by name
    reads_without_counterpart = True

    def load_sharded(self, directory: str, like: Mapping[str, Any], options: ShardedLoad) -> ShardedRead:
        """Read into new tensors placed like ``like`` (DCP reshards onto this run's processes),
        with the checksums of the files read whole, whatever ``options`` (`hashes_while_reading`);
        the live ones are untouched (the manager checks those checksums, and hashes the other
        files, before it restores anything).

        With ``options.defer``, when this process needs each file it reads whole (a restart on
        the same process count): the files are hashed (a folder's where they are, a store's
        objects into the private local copies ``options.copy_to`` names) and nothing is read into
        a tensor; each array comes back as a `DeferredArray` that fills the tensor of ``like`` in
        place once the manager checked everything (no second copy of this process's shard).
        Otherwise fresh tensors, as above.

        No collective (``no_dist=True``): each process plans its own reads from the shard files'
        headers. Run distributed, DCP would exchange its plans and metadata with torch's object
        collectives, which pickle and unpickle them; nothing on the load path unpickles. A
        failure here is this process's alone: the manager shares it in its next exchange."""
        from .storage import HashingReader

        # one reader for both passes; a folder's files are read where they are (copy_to is for a store's)
        one_pass = options.defer and options.hash_files and options.hash_when_placed
        copy_to = options.copy_to if options.defer and is_url(directory) and not one_pass else None
        reader = HashingReader(directory, defer=options.defer, hash_when_placed=one_pass, copy_to=copy_to)
        if any(value is None for value in like.values()):  # `reads_without_counterpart`
            like = _whole_where_lacking(directory, like, reader)
        if options.defer:
            _dcp_load(directory, dict(like), reader)  # plans and hashes; fills no tensor
            if reader.deferred and reader.whole:  # one pass: read and hashed as each is made
                return ShardedRead({key: _FillWhole(value, reader, reader.files_of.get(key, []))
                                    for key, value in like.items()}, reader.hashed,
                                   hashed_later=tuple(sorted(os.path.basename(path) for path in reader.whole)),
                                   later_hashes=lambda: dict(reader.hashed_later))
            if reader.deferred:
                return ShardedRead({key: _FillInPlace(value, reader.fills.get(key, [])) for key, value in like.items()},
                                   reader.hashed)
            reader.defer = False  # the same reader (a store's headers are not asked for again)
        target = {key: torch.empty_like(value) for key, value in like.items()}
        _dcp_load(directory, target, reader)
        return ShardedRead(target, reader.hashed)


def _whole_where_lacking(directory: str, like: Mapping[str, Any], reader: Any) -> Dict[str, Any]:
    """``like`` with each None (an array the live object lacks) replaced by a fresh host tensor
    of the whole array's shape and dtype, from the shard files' headers (DCP's metadata)."""
    try:
        saved = reader.read_metadata().state_dict_metadata
    except (RuntimeError, ValueError, KeyError, OSError) as err:
        raise CheckpointError(f"{directory}: the sharded arrays' headers cannot be read ({_first_line(err)}); "
                              "nothing was restored." + see("sharded-load-failed")) from err
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    whole = dict(like)
    for key, value in like.items():
        if value is None:
            meta = saved.get(key)
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{directory}: no shard file holds the sharded array {key!r} that the "
                                      "manifest lists; nothing was restored." + see("sharded-load-failed"))
            whole[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return whole


def _dcp_load(directory: str, target: Dict[str, Any], reader: Any) -> None:
    """``dcp.load`` of ``target`` through ``reader``, on this process alone; its failures as
    `CheckpointError`s."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(target, storage_reader=reader, no_dist=True)
    except (dcp.api.CheckpointException, RuntimeError, ValueError, KeyError, AssertionError, OSError) as err:
        raise CheckpointError(f"{directory}: the sharded arrays cannot be read into this run's objects "
                              f"({_first_line(err)}); nothing was restored." + see("sharded-load-failed")) from err


class _FillInPlace(DeferredArray):
    """A sharded tensor (``value``: the one the object holds) whose bytes were hashed in a first
    pass: `make` reads them into its memory in place (`backends.torch.storage.fill`) and returns it."""

    def __init__(self, value: Any, fills: List[Any]) -> None:
        self._value, self._fills = value, fills
        self.shape, self.dtype = tuple(value.shape), value.dtype

    def make(self) -> Any:
        from .storage import fill

        fill(self._fills)
        return self._value


class _FillWhole(DeferredArray):
    """A sharded tensor (``value``: the one the object holds) filled in one pass: `make` reads
    the files it comes from whole into every tensor they hold (`HashingReader.fill_whole`, once
    per file, hashed as it goes) and returns it."""

    def __init__(self, value: Any, reader: Any, paths: List[str]) -> None:
        self._value, self._reader, self._paths = value, reader, paths
        self.shape, self.dtype = tuple(value.shape), value.dtype

    def make(self) -> Any:
        self._reader.fill_whole(self._paths)
        return self._value


def _is_fsdp(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _placed_like(state: Any, live: Any) -> Any:
    """``state`` with each plain tensor whose counterpart in ``live`` (this run's state, the same
    keys) is a DTensor of its shape made a DTensor placed like it, from this process's part of
    the whole tensor (no collective). A checkpoint saved on another mesh holds whole the arrays
    replicated there (a bias under ``RowwiseParallel``), which this run may shard (FSDP2's
    ``Shard(0)``): DTensor's in-place ``copy_`` cannot change the placement of a replicated source."""
    DTensor = _dtensor()
    if isinstance(state, torch.Tensor) and not isinstance(state, DTensor):
        if isinstance(live, DTensor) and tuple(live.shape) == tuple(state.shape):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(state, live.device_mesh, live.placements, src_data_rank=None)
        return state
    if isinstance(state, dict) and isinstance(live, Mapping):
        return {k: _placed_like(v, live[k]) if k in live else v for k, v in state.items()}
    if isinstance(state, (list, tuple)) and isinstance(live, (list, tuple)) and len(state) == len(live):
        return type(state)(_placed_like(v, w) for v, w in zip(state, live))
    return state


def _placeholders(state: Any) -> Any:
    """``state`` with every DTensor replaced by a meta tensor of its global shape and dtype (what
    a non-main process describes of a full-state checkpoint, without holding the arrays)."""
    DTensor = _dtensor()
    if isinstance(state, DTensor):
        return torch.empty(state.shape, dtype=state.dtype, device="meta")
    if isinstance(state, dict):
        return {k: _placeholders(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_placeholders(v) for v in state)
    return state


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
