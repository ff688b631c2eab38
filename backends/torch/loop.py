"""torch's side of the training loop: autocast, fp16 loss scaling, accumulation, clipping.

The rules (when a window closes, how often a scheduler steps) are `unified.training.loop`'s;
this module applies them to torch objects as Accelerate does: prepared optimizers and
schedulers are thin wrappers that step only on accumulation boundaries, a prepared model's
forward runs under ``torch.autocast`` and returns float32, ``backward`` divides the loss by the
number of accumulation steps and scales it under fp16.
"""
from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from unified.backend import TrainingLoop
from unified.training.loop import GradientState, LoopSettings, scheduler_steps

from . import private

__all__ = ["TorchTrainingLoop", "PreparedOptimizer", "PreparedScheduler"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TorchTrainingLoop(TrainingLoop):
    """Mixed into `TorchBackend`: what `unified.backend.TrainingLoop` asks of torch."""

    mixed_precisions = ("no", "fp16", "bf16")
    kwargs_handlers = ("DistributedDataParallelKwargs", "GradScalerKwargs", "AutocastKwargs")
    _loop: Optional[LoopSettings] = None
    _scaler: Optional[Any] = None

    def configure_loop(self, settings: LoopSettings) -> None:
        self._loop = settings
        self._loop_models: List[Any] = []
        self._loop_optimizers: List["PreparedOptimizer"] = []
        if settings.mixed_precision == "fp16":
            self._scaler = torch.amp.GradScaler(self.device.type, **settings.loss_scaler_options)

    @property
    def _gradients(self) -> GradientState:
        return self._loop.gradients if self._loop is not None else GradientState()

    # -- preparing -------------------------------------------------------------------------------
    def loop_model(self, model: Any) -> Any:
        """The user's model, its forward under autocast when a mixed precision is on."""
        dtype = _DTYPES.get(self._loop.mixed_precision if self._loop else "no")
        if dtype is not None and "_unified_original_forward" not in model.__dict__:
            model._unified_original_forward = model.forward
            model.forward = types.MethodType(_autocast_forward(model.forward.__func__, self.device.type, dtype,
                                                               self._loop.autocast_options), model)
        return model

    def loop_prepared_model(self, model: Any) -> None:
        if self._loop is not None:
            self._loop_models.append(model)

    def loop_optimizer(self, optimizer: Any) -> Any:
        if self._loop is None:  # a backend used without an Accelerator: the user's optimizer as is
            return optimizer
        prepared = optimizer if isinstance(optimizer, PreparedOptimizer) else PreparedOptimizer(
            optimizer, self._gradients, self._scaler)
        self._gradients.step_skipped.append(functools.partial(getattr, prepared, "step_was_skipped"))  # picklable
        self._loop_optimizers.append(prepared)
        return prepared

    def loop_scheduler(self, scheduler: Any) -> "PreparedScheduler":
        if isinstance(scheduler, PreparedScheduler) or self._loop is None:
            return scheduler
        return PreparedScheduler(scheduler, self._loop)

    def strip_autocast(self, model: Any) -> Any:
        """``unwrap_model(..., keep_fp32_wrapper=False)``: the model's own forward back."""
        original = model.__dict__.pop("_unified_original_forward", None)
        if original is not None:
            model.forward = original
        return model

    # -- inside the loop --------------------------------------------------------------------------
    def autocast(self) -> Any:
        dtype = _DTYPES.get(self._loop.mixed_precision if self._loop else "no")
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype, **(self._loop.autocast_options if self._loop else {}))

    def loss_for_backward(self, loss: Any) -> Any:
        """The loss divided by the accumulation steps, scaled under fp16."""
        steps = self._gradients.num_steps
        if steps > 1:
            loss = loss / steps
        return self._scaler.scale(loss) if self._scaler is not None else loss

    def no_sync(self, model: Any) -> Any:
        sharded = self.sharded_no_sync(model) if getattr(self, "sharding_enabled", False) else None
        if sharded is not None:
            return sharded
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    def join_uneven_inputs(self, joinables: Any) -> Any:
        from torch.distributed.algorithms.join import Join

        return Join(joinables, enable=True, throw_on_early_termination=False)

    @contextlib.contextmanager
    def sync_in_backward(self, model: Any) -> Any:
        """DDP's gradients reduced by the next backward even inside ``no_sync``, as Accelerate's
        ``trigger_sync_in_backward`` (it sets the same flags and prepares the reducer)."""
        if not isinstance(model, DDP):
            yield
            return
        before = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = before

    @property
    def loss_scaler(self) -> Optional[Any]:
        return self._scaler

    def unscale_gradients(self) -> None:
        self._unscale()

    def _unscale(self) -> None:
        """fp16: divide the gradients by the loss scale once per step, before they are read."""
        if self._scaler is None or not self._gradients.sync_gradients:
            return
        for optimizer in self._loop_optimizers:
            try:
                self._scaler.unscale_(optimizer.optimizer)
            except RuntimeError as err:  # already unscaled in this step (a second clip): fine
                if "already been called" not in str(err):
                    raise

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        self._unscale()
        if getattr(self, "sharding_enabled", False):
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            norm = self.sharded_clip_grad_norm_(parameters, max_norm, norm_type)
            if norm is not None:
                return norm
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> Any:
        self._unscale()
        return torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- checkpoints -------------------------------------------------------------------------------
    def loop_state(self) -> Dict[str, Any]:
        """The fp16 scaler, and the gradients accumulated so far in an open window.

        Inside an open window each process holds its own partial gradients (DDP's ``no_sync``).
        The checkpoint holds their mean over processes (copies: the running training is left
        as it is), which the closing all-reduce of a resumed run averages again to the same
        result (the mean is linear), so one copy, written by the main process, resumes every
        process; equal to the uninterrupted run up to float rounding of that mean.
        """
        state: Dict[str, Any] = {}
        if self._scaler is not None:
            state["scaler"] = self._scaler.state_dict()
        if self._gradients.step == 0:
            return state
        if getattr(self, "sharding_enabled", False) and self.sharded_models_open_window():
            from unified.errors import CheckpointError, see

            raise CheckpointError(
                "save_state() inside an open gradient-accumulation window of a sharded (FSDP2) model: its partial "
                "gradients live unsharded inside FSDP and are not saved. Save when accelerator.sync_gradients is "
                "True (after the optimizer step)." + see("fsdp-accumulation-window"))
        gradients = {}
        for index, model in enumerate(self._loop_models):
            named = {name: p.grad.detach().clone() for name, p in self.unwrap_model(model).named_parameters()
                     if p.grad is not None}
            if self.num_processes > 1:
                with self.peer_errors("save_state() (averaging the gradients of an open accumulation window)"):
                    for grad in named.values():
                        torch.distributed.all_reduce(grad, op=torch.distributed.ReduceOp.SUM)
                        grad.div_(self.num_processes)
            gradients[f"model_{index}"] = named
        state["gradients"] = gradients
        return state

    def load_loop_state(self, state: Dict[str, Any]) -> None:
        if self._scaler is not None and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
        saved = state.get("gradients", {})
        for index, model in enumerate(self._loop_models):
            grads = saved.get(f"model_{index}", {})
            for name, p in self.unwrap_model(model).named_parameters():
                grad = grads.get(name)
                p.grad = None if grad is None else grad.detach().to(device=p.device, dtype=p.dtype).clone()


def _autocast_forward(forward: Callable[..., Any], device_type: str, dtype: Any,
                      options: Dict[str, Any]) -> Callable[..., Any]:
    """``forward`` under ``torch.autocast`` (with ``options``: ``AutocastKwargs``), its floating
    outputs back in float32 (as Accelerate)."""

    @functools.wraps(forward)
    def autocast_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype, **options):
            outputs = forward(self, *args, **kwargs)
        return _to_float32(outputs)

    return autocast_forward


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, dict):
        return (type(value)({k: _to_float32(v) for k, v in value.items()}) if type(value) is dict
                else _map_mapping(value))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_float32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(v) for v in value)
    return value


def _map_mapping(value: Any) -> Any:
    """Mappings such as Hugging Face's ``ModelOutput`` keep their type; values converted in place."""
    for key in list(value.keys()):
        value[key] = _to_float32(value[key])
    return value


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping only when an accumulation window closes (and, under fp16,
    through the loss scaler, skipping a step whose gradients overflowed).

    ``optimizer.optimizer`` is the user's object; ``optimizer.step_was_skipped`` tells whether
    the last boundary's step was skipped (Accelerate's names).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradients: GradientState, scaler: Optional[Any]) -> None:
        # No super().__init__: the state lives in the user's optimizer (as in Accelerate).
        self.optimizer = optimizer
        self._gradients = gradients
        self._scaler = scaler
        self._is_overflow = False

    # the user's optimizer's state, seen through this wrapper
    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gradients.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        if not self._gradients.sync_gradients:
            return None
        if self._scaler is None:
            self._is_overflow = False
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        scale = self._scaler.get_scale()
        result = (self._scaler.step(self.optimizer, closure) if closure is not None
                  else self._scaler.step(self.optimizer))
        self._scaler.update()
        self._is_overflow = self._scaler.get_scale() < scale
        return result

    @property
    def step_was_skipped(self) -> bool:
        """True when the last boundary's step was skipped because of inf/NaN gradients (fp16)."""
        return self._is_overflow

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    # pickle and copy the wrapper itself (torch's Optimizer.__getstate__ would keep only what the
    # properties above show, and its __setstate__ would set them before ``optimizer`` exists)
    def __getstate__(self) -> Dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """The user's LR scheduler, stepped as Accelerate steps it (see
    `unified.training.loop.scheduler_steps`). ``scheduler.scheduler`` is the user's object."""

    def __init__(self, scheduler: Any, settings: LoopSettings) -> None:
        self.scheduler = scheduler
        self._settings = settings

    def step(self, *args: Any, **kwargs: Any) -> None:
        for _ in range(scheduler_steps(self._settings)):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses steps past its end
            if total is not None and private.scheduler_step_count(self.scheduler) > total:
                return
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> Any:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"

