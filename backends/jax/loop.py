"""JAX's side of the training loop: bf16 compute in NNX modules, accumulating optimizers, clipping.

The rules are `unified.training.loop`'s. On JAX the gradients are computed inside the user's
jitted step, so accumulation lives in the prepared ``nnx.Optimizer``: its optax transformation
is wrapped by `accumulate_gradients`, which adds each call's gradients divided by N and applies
them on the N-th call (or at a prepared loader's last batch, as torch does), inside ``jit``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from unified.backend import TrainingLoop
from unified.errors import see
from unified.training.loop import GradientState, LoopSettings

__all__ = ["JaxTrainingLoop", "accumulate_gradients", "clip_by_global_norm"]


class AccumulationState(NamedTuple):
    mini_step: Any   # calls since the window opened (int32)
    acc_grads: Any   # sum of gradients / N so far
    inner: Any       # the user's transformation's state
    flush: Any       # bool: apply at the next call whatever mini_step is (the loader's last batch)


def accumulate_gradients(inner: optax.GradientTransformation, every: int) -> optax.GradientTransformation:
    """``inner`` applied to the mean gradient of ``every`` calls (zero updates in between).

    Like ``optax.MultiSteps`` with a window that a host-side flag can close early, so that the
    last, incomplete window of an epoch is applied as torch applies it (sum of its gradients / N).

    Example:
        >>> tx = accumulate_gradients(optax.sgd(0.1), every=4)
    """

    def init(params: Any) -> AccumulationState:
        return AccumulationState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params), inner.init(params),
                                 jnp.zeros([], jnp.bool_))

    def update(grads: Any, state: AccumulationState, params: Any = None, **extra: Any) -> Tuple[Any, AccumulationState]:
        acc = jax.tree.map(lambda a, g: a + (g / every).astype(a.dtype), state.acc_grads, grads)
        mini = state.mini_step + 1

        def apply(_: Any) -> Tuple[Any, AccumulationState]:
            updates, inner_state = inner.update(acc, state.inner, params, **extra)
            return updates, AccumulationState(jnp.zeros_like(mini), jax.tree.map(jnp.zeros_like, acc), inner_state,
                                              jnp.zeros_like(state.flush))

        def hold(_: Any) -> Tuple[Any, AccumulationState]:
            return jax.tree.map(jnp.zeros_like, acc), AccumulationState(mini, acc, state.inner, state.flush)

        return jax.lax.cond((mini >= every) | state.flush, apply, hold, None)

    return optax.GradientTransformationExtraArgs(init, update)


def clip_by_global_norm(grads: Any, max_norm: float, norm_type: float = 2.0) -> Tuple[Any, Any]:
    """``(clipped grads, total norm before clipping)`` with torch's rule (coefficient
    ``max_norm / (norm + 1e-6)``, at most 1); usable inside ``jit``.

    Example:
        >>> clipped, norm = clip_by_global_norm(grads, 1.0)
    """
    leaves = [jnp.asarray(g, jnp.float32) for g in jax.tree.leaves(grads)]
    if not leaves:
        return grads, jnp.zeros([], jnp.float32)
    if norm_type == float("inf"):
        norm = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in leaves]))
    else:
        p = float(norm_type)
        norm = jnp.sum(jnp.stack([jnp.sum(jnp.abs(g) ** p) for g in leaves])) ** (1.0 / p)
    coefficient = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return jax.tree.map(lambda g: (g * coefficient).astype(g.dtype), grads), norm


class JaxTrainingLoop(TrainingLoop):
    """Mixed into `JaxBackend`: what `unified.backend.TrainingLoop` asks of JAX."""

    mixed_precisions = ("no", "bf16")
    _loop: Optional[LoopSettings] = None

    def configure_loop(self, settings: LoopSettings) -> None:
        self._loop = settings
        self._loop_models: List[Any] = []
        self._accumulating: List[Any] = []

    @property
    def _gradients(self) -> GradientState:
        return self._loop.gradients if self._loop is not None else GradientState()

    # -- preparing -------------------------------------------------------------------------------
    def loop_model(self, model: Any) -> None:
        """bf16: every layer of the module computes in bfloat16; parameters keep their dtype."""
        if self._loop is None:
            return
        self._loop_models.append(model)
        if self._loop.mixed_precision != "bf16":
            return
        from flax import nnx

        for _, module in nnx.iter_modules(model):
            if hasattr(module, "dtype") and hasattr(module, "param_dtype") and module.dtype in (None, jnp.float32):
                module.dtype = jnp.bfloat16

    def loop_optimizer(self, optimizer: Any) -> None:
        """N > 1: the optimizer's transformation accumulates (see `accumulate_gradients`)."""
        steps = self._gradients.num_steps
        if steps == 1 or isinstance(getattr(optimizer, "_unified_accumulating", None), int):
            return
        from flax import nnx
        from flax.nnx.training.optimizer import to_opt_state

        params = self._parameters_of(optimizer)
        inner = _as_pure(optimizer.opt_state)
        optimizer.tx = accumulate_gradients(optimizer.tx, steps)
        # the window's sums live where their parameters live (split over the mesh when sharded)
        sums = jax.tree.map(lambda p: jax.jit(jnp.zeros_like, out_shardings=p.sharding)(p), params)
        fresh = AccumulationState(self._replicated(np.zeros([], np.int32)), sums, inner,
                                  self._replicated(np.zeros([], np.bool_)))
        optimizer.opt_state = nnx.data(to_opt_state(fresh))
        optimizer._unified_accumulating = steps
        self._accumulating.append(optimizer)

    def _parameters_of(self, optimizer: Any) -> Any:
        """The prepared model whose parameters this optimizer updates (its state's structure)."""
        from flax import nnx

        wanted = jax.tree.structure(_as_pure(optimizer.opt_state))
        for model in self._loop_models:
            params = _as_pure(nnx.state(model, optimizer.wrt))
            if jax.tree.structure(jax.eval_shape(optimizer.tx.init, params)) == wanted:
                return params
        raise ValueError(
            "gradient_accumulation_steps > 1 on JAX needs the optimizer's model prepared first: "
            "call accelerator.prepare(model, optimizer, ...) with the model before its optimizer."
            + see("accumulation-needs-model"))

    def before_micro_step(self) -> None:
        """At a prepared loader's last batch the accumulating optimizers apply what they hold."""
        if self._gradients.end_of_dataloader:
            for optimizer in self._accumulating:
                optimizer.opt_state.flush[...] = self._replicated(np.asarray(True))

    def _replicated(self, value: Any) -> Any:
        """``value`` as an array replicated over the mesh, like every other leaf of the state."""
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = NamedSharding(self.mesh, PartitionSpec())
        host = np.asarray(jax.device_get(value))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    # -- inside the loop --------------------------------------------------------------------------
    def autocast(self) -> Any:
        return contextlib.nullcontext()  # prepared modules compute in bf16 themselves

    def no_sync(self, model: Any) -> Any:
        return contextlib.nullcontext()  # the jitted step's gradients are global: nothing to hold back

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        return clip_by_global_norm(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> Any:
        return jax.tree.map(lambda g: jnp.clip(g, -clip_value, clip_value), parameters)

    # -- checkpoints: the window's gradients live in the optimizer's state ------------------------
    def loop_state(self) -> Dict[str, Any]:
        return {}

    def load_loop_state(self, state: Dict[str, Any]) -> None:
        return None


def _as_pure(tree: Any) -> Any:
    """``nnx.as_pure``: ``tree`` with every ``Variable`` replaced by its value. flax added it in
    0.12.7; for the older supported releases (README, "Supported versions") it is written out as
    flax 0.12.8 does it."""
    from flax import nnx
    from flax.nnx import variablelib

    if hasattr(nnx, "as_pure"):
        return nnx.as_pure(tree)

    def pure(leaf: Any) -> Any:
        if isinstance(leaf, nnx.Variable):
            return _as_pure(leaf.get_raw_value())
        if variablelib.is_array_ref(leaf):
            return leaf[...]
        return leaf

    return jax.tree.map(pure, tree, is_leaf=lambda leaf: isinstance(leaf, nnx.Variable))
