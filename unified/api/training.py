"""The training loop (`unified.Accelerator`'s part): gradient accumulation, ``no_sync``,
``autocast``, clipping and the JAX key stream; the rules are `unified.training.loop`'s."""
from __future__ import annotations

import contextlib
from typing import Any

from ..backend import KeyStream, TrainingLoop, require
from ..training.loop import resolve_accumulation_steps


class TrainingLoopCalls:
    """Mixed into `unified.Accelerator`: uses its backend, collectives and state."""

    # -- the training loop ----------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (``Accelerator(gradient_accumulation_steps=...)``);
        settable, as in Accelerate (``accelerator.gradient_accumulation_steps = 4``).

        Example:
            >>> accelerator.gradient_accumulation_steps = 4
        """
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        steps = resolve_accumulation_steps(value)
        if steps > 1 and self._loop is None:
            require(self._backend, TrainingLoop, f"accelerator.gradient_accumulation_steps = {steps}")
        self.gradient_state.num_steps = steps
        self._checkpoint_loop_state()

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-batch that closes an accumulation window (every N-th one, and the
        last batch of a prepared loader): the optimizer really steps then.

        Example:
            >>> with accelerator.accumulate(model):
            ...     accelerator.backward(loss)
            ...     if accelerator.sync_gradients:
            ...         accelerator.clip_grad_norm_(model.parameters(), 1.0)
        """
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when a prepared optimizer skipped its last step (fp16 gradients with inf/NaN).

        Example:
            >>> if not accelerator.optimizer_step_was_skipped:
            ...     ema.update(model)
        """
        return self.gradient_state.optimizer_step_skipped

    @contextlib.contextmanager
    def accumulate(self, *models: Any) -> Any:
        """One micro-batch of gradient accumulation: inside, gradients are not synchronised
        across processes and prepared optimizers/schedulers do not step, except on the
        micro-batch that closes the window (`sync_gradients`). ``backward`` divides the loss by
        ``gradient_accumulation_steps``. On JAX the prepared ``nnx.Optimizer`` accumulates by
        itself; ``accumulate`` keeps the count (and closes the window at a loader's end).

        Example:
            >>> accelerator = Accelerator(gradient_accumulation_steps=4)
            >>> for batch in loader:
            ...     with accelerator.accumulate(model):
            ...         loss = model(batch).mean()
            ...         accelerator.backward(loss)
            ...         optimizer.step()
            ...         optimizer.zero_grad()
        """
        self.gradient_state.advance()
        with contextlib.ExitStack() as stack:
            if self._loop is not None:
                self._loop.before_micro_step()
                if not self.gradient_state.sync_gradients:
                    for model in models:
                        stack.enter_context(self._loop.no_sync(model))
            yield

    def no_sync(self, model: Any) -> "contextlib.AbstractContextManager[None]":
        """Gradients computed inside are not synchronised across processes (DDP's ``no_sync``;
        a no-op on JAX, whose jitted step computes global gradients).

        Example:
            >>> with accelerator.no_sync(model):
            ...     accelerator.backward(loss)       # local gradients only
        """
        return require(self._backend, TrainingLoop, "accelerator.no_sync()").no_sync(model)

    def autocast(self) -> "contextlib.AbstractContextManager[None]":
        """Compute in the Accelerator's mixed precision outside a prepared forward (torch:
        ``torch.autocast``; JAX: a no-op, prepared modules already compute in bf16).

        Example:
            >>> with accelerator.autocast():
            ...     loss = loss_fn(model(x), y)
        """
        if self._loop is None:
            return contextlib.nullcontext()
        return self._loop.autocast()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Clip gradients to a total ``max_norm``. torch: ``parameters`` as for
        ``torch.nn.utils.clip_grad_norm_`` (unscaled first under fp16); returns the total norm
        before clipping. JAX: ``parameters`` is the gradient tree; returns ``(clipped, norm)``
        and works inside ``jit``.

        Example:
            >>> norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)          # torch
            >>> grads, norm = accelerator.clip_grad_norm_(grads, 1.0)                # JAX
        """
        return require(self._backend, TrainingLoop, "accelerator.clip_grad_norm_()").clip_grad_norm_(
            parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> Any:
        """Clip every gradient element to ``[-clip_value, clip_value]`` (torch: in place, unscaled
        first under fp16; JAX: returns the clipped gradient tree).

        Example:
            >>> accelerator.clip_grad_value_(model.parameters(), 0.5)
        """
        return require(self._backend, TrainingLoop, "accelerator.clip_grad_value_()").clip_grad_value_(
            parameters, clip_value)

    def next_key(self) -> Any:
        """A fresh ``jax.random`` key from the Accelerator's stream (seeded by ``seed``; saved
        and restored with every checkpoint). JAX backend only.

        Example:
            >>> dropout_key = accelerator.next_key()
        """
        return require(self._backend, KeyStream, "accelerator.next_key()").next_key()
