"""Sharded training: the settings of `FullyShardedDataParallelPlugin` (Accelerate's name), shared
by every backend that implements the `unified.backend.ShardedTraining` capability.

torch applies FSDP2 (`fully_shard`, DTensor parameters) over a mesh of every process; JAX places
NNX parameters and optimizer state sharded over its mesh. This module only holds and checks the
settings; it imports neither framework.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

from ..errors import see

WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """How `Accelerator.prepare` shards models (fields with Accelerate's names and meaning).

    Args:
        fsdp_version: only 2 (FSDP2, ``torch.distributed.fsdp.fully_shard``) is supported.
        auto_wrap_policy: which submodules get their own shard group (torch):
            ``"transformer_based_wrap"`` (the classes named in ``transformer_cls_names_to_wrap``),
            ``"size_based_wrap"`` (submodules with at least ``min_num_params`` parameters),
            ``"no_wrap"`` (only the root), or a callable ``(module) -> bool``. ``None`` picks
            ``transformer_based_wrap`` when class names are given, else ``size_based_wrap`` when
            ``min_num_params`` is set, else ``no_wrap``.
        transformer_cls_names_to_wrap: class names of the layers to wrap one by one.
        min_num_params: the size threshold of ``size_based_wrap``.
        reshard_after_forward: free the gathered parameters after the forward (ZeRO-3) or keep
            them until the backward (ZeRO-2 style); torch only, JAX compiles its own schedule.
        state_dict_type: ``"SHARDED_STATE_DICT"`` (every process writes its own shards; the
            default) or ``"FULL_STATE_DICT"`` (checkpoints hold whole arrays).

    Example:
        >>> from unified import Accelerator, FullyShardedDataParallelPlugin
        >>> plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
        >>> accelerator = Accelerator(fsdp_plugin=plugin)  # doctest: +SKIP
        >>> model, optimizer = accelerator.prepare(model, optimizer)  # doctest: +SKIP
    """

    fsdp_version: int = 2
    auto_wrap_policy: Union[str, Callable[[Any], bool], None] = None
    transformer_cls_names_to_wrap: Optional[Sequence[str]] = None
    min_num_params: int = 0
    reshard_after_forward: bool = True
    state_dict_type: str = "SHARDED_STATE_DICT"

    def __post_init__(self) -> None:
        if self.fsdp_version != 2:
            raise ValueError(f"fsdp_version={self.fsdp_version!r}: unified supports FSDP2 only (fsdp_version=2, "
                             "torch's fully_shard); FSDP1's FullyShardedDataParallel wrapper is not supported."
                             + see("fsdp-plugin"))
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [n.strip() for n in self.transformer_cls_names_to_wrap.split(",")
                                                  if n.strip()]
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = ("transformer_based_wrap" if self.transformer_cls_names_to_wrap
                                     else "size_based_wrap" if self.min_num_params > 0 else "no_wrap")
        if not callable(self.auto_wrap_policy) and self.auto_wrap_policy not in WRAP_POLICIES:
            raise ValueError(f"auto_wrap_policy={self.auto_wrap_policy!r}: use one of {', '.join(WRAP_POLICIES)} or a "
                             "callable (module) -> bool." + see("fsdp-plugin"))
        if self.auto_wrap_policy == "transformer_based_wrap" and not self.transformer_cls_names_to_wrap:
            raise ValueError("auto_wrap_policy='transformer_based_wrap' needs transformer_cls_names_to_wrap (the class "
                             "names of the layers to wrap)." + see("fsdp-plugin"))
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={self.state_dict_type!r}: use one of {', '.join(STATE_DICT_TYPES)}."
                             + see("fsdp-plugin"))
        if not isinstance(self.min_num_params, int) or self.min_num_params < 0:
            raise ValueError(f"min_num_params={self.min_num_params!r}: use a whole number >= 0." + see("fsdp-plugin"))
