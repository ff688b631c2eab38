"""Accelerate's names for what unified does not have: the constructor keywords of features it
lacks (`check_accelerate_kwargs`: accepted at their "not in use" values, refused otherwise with
what to do instead) and `AbsentFeatures`, the `unified.Accelerator`'s handlers, plugins,
parallel ranks, no-op contexts and methods of DeepSpeed, fp8, LOMO, profiling and parallelism,
each answering as an Accelerate run without the feature (or with a clear error). It reads
nothing of the Accelerator."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict

from ..config import GradientAccumulationPlugin
from ..errors import see

__all__ = ["AbsentFeatures", "check_accelerate_kwargs"]

# Accelerate's constructor keywords for features unified does not have: accepted at the values
# that mean "not in use" (as scripts pass them), refused otherwise with what to do instead.
_ACCELERATE_KWARGS = {
    "cpu": ((False, True), "unified runs on the backend's device"),
    "dispatch_batches": ((None, False), "every process reads its own share"),
    "even_batches": ((True,), "pass dataloader_config=DataLoaderConfiguration(even_batches=False)"),
    "device_placement": ((True,), "prepared objects are always placed on accelerator.device"),
    "rng_types": ((None,), "every generator is saved and restored; none is synchronised per batch"),
    "deepspeed_plugin": ((None,), "shard models with fsdp_plugin=unified.FullyShardedDataParallelPlugin() (FSDP2)"),
    "deepspeed_plugins": ((None,), "shard models with fsdp_plugin=unified.FullyShardedDataParallelPlugin() (FSDP2)"),
    "megatron_lm_plugin": ((None,), "Megatron-LM is not supported; shard with fsdp_plugin"),
    "torch_tp_plugin": ((None,), "use parallelism_config=unified.ParallelismConfig(tp_size=...) (Accelerate's "
                        "replacement of the deprecated plugin)"),
    "dynamo_plugin": ((None,), "call torch.compile(model) yourself before prepare()"),
    "dynamo_backend": ((None, "no", "NO"), "call torch.compile(model) yourself before prepare()"),
}


def check_accelerate_kwargs(kwargs: Dict[str, Any], gradient_accumulation_steps: int) -> int:
    """Accelerate's other constructor keywords (`_ACCELERATE_KWARGS`, ``split_batches`` and
    ``gradient_accumulation_plugin``); returns the accumulation steps to use. A keyword Accelerate
    does not have is a `TypeError`; a value unified does not implement a `NotImplementedError`."""
    if kwargs.pop("split_batches", False):
        # Accelerate 1.15 takes the argument and ignores it (DataLoaderConfiguration holds the
        # setting); a script passing it runs as it runs there, and is told so
        warnings.warn("Accelerator(split_batches=True) is ignored, as Accelerate 1.15 ignores it: each process gets "
                      "the loader's batch_size. DataLoaderConfiguration(split_batches=True) is not supported by "
                      "unified." + see("not-supported-yet"), FutureWarning, stacklevel=3)
    plugin = kwargs.pop("gradient_accumulation_plugin", None)
    if plugin is not None:
        gradient_accumulation_steps = GradientAccumulationPlugin.steps_of(plugin, gradient_accumulation_steps)
    for name, value in kwargs.items():
        if name not in _ACCELERATE_KWARGS:
            raise TypeError(
                f"Accelerator() got an unexpected keyword argument {name!r}. Accepted: backend, mixed_precision, "
                f"gradient_accumulation_steps, gradient_accumulation_plugin, handle_preemption, log_with, fsdp_plugin, "
                f"dataloader_config, step_scheduler_with_optimizer, project_dir, project_config, seed, timeout, and "
                f"Accelerate's {', '.join(sorted(_ACCELERATE_KWARGS))} at their default values."
                + see("unexpected-keyword"))
        accepted, instead = _ACCELERATE_KWARGS[name]
        if value not in accepted:
            raise NotImplementedError(f"Accelerator({name}={value!r}) is not supported by unified: {instead} (or pass "
                                      f"one of {accepted!r})." + see("not-supported-yet"))
    return gradient_accumulation_steps


def _unsupported(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not supported by unified: {instead}." + see("not-supported-yet"))


class AbsentFeatures:
    """Mixed into `unified.Accelerator` (through `unified.compat.surface.AccelerateSurface`):
    Accelerate's names of features unified does not have."""

    # Accelerate's handlers and plugins of features unified does not have (DeepSpeed, fp8, LOMO,
    # parallelism_config, dynamo, profiling): always their "not in use" value, as on an
    # Accelerate run that does not use them. The four kwargs handlers unified takes are set by
    # the constructor (see `unified.compat.kwargs_handlers`).
    profile_handler = None
    fp8_recipe_handler = None
    ao_recipe_handler = None
    te_recipe_handler = None
    msamp_recipe_handler = None
    deepspeed_plugin = None
    parallelism_config = None
    torch_device_mesh = None
    rng_types = None  # unified saves and restores every generator; none is synchronised per batch
    flag_tensor = None  # the trigger travels through the backend's collectives, not a tensor
    device_placement = True
    fp8_enabled = False
    delayed_fp8_autocast = False
    has_fp8_handler = False
    has_lomo_optimizer = False
    fp8_backend = "NO"

    def _no_parallelism(self, what: str) -> Any:
        raise RuntimeError(f"{what} is not configured. Set `parallelism_config` first (Accelerator("
                           "parallelism_config=unified.ParallelismConfig(...))); without one each process's data "
                           "rank is accelerator.process_index." + see("no-parallelism-config"))

    data_parallel_rank = property(lambda self: self._no_parallelism("Data parallelism"))
    data_parallel_shard_rank = property(lambda self: self._no_parallelism("Shard-based data parallelism"))
    tensor_parallel_rank = property(lambda self: self._no_parallelism("Tensor parallelism"))

    @property
    def pipeline_parallel_rank(self) -> int:
        raise _unsupported("Pipeline parallelism", "as in Accelerate, which does not support it either")

    @property
    def context_parallel_rank(self) -> int:
        raise _unsupported("Context parallelism", "as in Accelerate, which does not support it either")

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: Any = None, buffer_seq_dims: Any = None,
                               no_restore_buffers: Any = None) -> Any:
        """A no-op context, as Accelerate's without context parallelism.

        Example:
            >>> with accelerator.maybe_context_parallel():
            ...     loss = model(batch)
        """
        yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """``dl`` unchanged, as Accelerate's without DeepSpeed sequence parallelism.

        Example:
            >>> loader = accelerator.deepspeed_ulysses_dl_adapter(loader, model)
        """
        return dl

    def lomo_backward(self, loss: Any, learning_rate: float) -> None:
        """Not supported (LOMO optimizers).

        Example:
            >>> accelerator.backward(loss)   # what to call instead
        """
        raise _unsupported("lomo_backward (LOMO optimizers)", "use a standard optimizer and accelerator.backward(loss)")

    def profile(self, profile_handler: Any = None) -> Any:
        """Not supported: profile with the framework's own profiler.

        Example:
            >>> with torch.profiler.profile() as prof:   # torch
            ...     train_step()
        """
        raise _unsupported("accelerator.profile()", "use torch.profiler.profile() (torch) or jax.profiler.trace() "
                           "(JAX) around the code to profile")
