"""Models that Accelerate's big-model utilities (``load_checkpoint_and_dispatch``,
``dispatch_model``, ``cpu_offload``) left on the meta device, their weights held elsewhere by an
``AlignDevicesHook``: their state is read by onloading one module at a time, as Accelerate's
``save_model`` does. Only such a model reaches Accelerate's code here, so unified imports
Accelerate only when a model carries its hooks."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from unified.errors import see


def _offloaded(module: torch.nn.Module) -> bool:
    hook = getattr(module, "_hf_hook", None)
    return hook is not None and bool(getattr(hook, "offload", False))


def offloaded_state(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """The model's full state on the CPU when some of its modules are offloaded by Accelerate's
    hooks (each module's weights brought back in turn); None for any other model. A model with
    parameters on the meta device and no offload hook is an error: there are no weights to save."""
    if any(_offloaded(module) for module in model.modules()):
        from accelerate.utils.modeling import get_state_dict_offloaded_model

        return get_state_dict_offloaded_model(model)
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise RuntimeError(
            f"Cannot read the weights of this model: {len(meta)} parameter(s) are on the meta device and no offload "
            f"hook holds their values (first: {meta[0]!r}). Load the weights first (e.g. "
            "accelerate.load_checkpoint_and_dispatch, or model.to_empty(device=...) and load_state_dict)."
            + see("meta-device-model"))
    return None
