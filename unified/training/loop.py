"""The training loop's shared rules: mixed-precision settings and gradient accumulation.

Written once for every backend. A backend with the `unified.backend.TrainingLoop` capability
applies them to the objects it prepares (torch: autocast, loss scaling, skipped optimizer and
scheduler steps; JAX: bf16 compute in NNX modules, an optimizer that accumulates); the position
inside an accumulation window is saved with every checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..errors import see

__all__ = ["PRECISIONS", "GradientState", "LoopSettings", "resolve_mixed_precision", "resolve_accumulation_steps",
           "scheduler_steps"]

PRECISIONS = ("no", "fp16", "bf16")
PRECISION_VARIABLE = "UNIFIED_MIXED_PRECISION"


def resolve_mixed_precision(value: Optional[str]) -> str:
    """``value``, else ``$UNIFIED_MIXED_PRECISION`` (set by ``unified launch --mixed-precision``),
    else ``"no"``; any other spelling is refused.

    Example:
        >>> resolve_mixed_precision("bf16")
        'bf16'
    """
    chosen = value if value is not None else os.environ.get(PRECISION_VARIABLE) or "no"
    chosen = str(chosen).lower()
    if chosen not in PRECISIONS:
        where = f"mixed_precision={value!r}" if value is not None else f"{PRECISION_VARIABLE}={chosen!r}"
        raise ValueError(f"Unknown {where}: expected one of {', '.join(map(repr, PRECISIONS))}."
                         + see("mixed-precision-unknown"))
    return chosen


def resolve_accumulation_steps(value: Any) -> int:
    """``gradient_accumulation_steps`` as a positive int, or a clear error.

    Example:
        >>> resolve_accumulation_steps(4)
        4
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"gradient_accumulation_steps must be an integer >= 1; received {value!r}."
                         + see("accumulation-steps-invalid"))
    return value


@dataclass
class GradientState:
    """Where the loop stands inside a gradient-accumulation window (Accelerate's meaning).

    ``accelerator.accumulate(model)`` calls `advance` once per micro-batch: the window closes
    (``sync_gradients`` becomes True) on every ``num_steps``-th micro-batch and on the last
    batch of a prepared loader. Prepared loaders report their last batch through `saw_batch`.

    Example:
        >>> state = GradientState(num_steps=2)
        >>> [state.advance() or state.sync_gradients for _ in range(4)]
        [False, True, False, True]
    """

    num_steps: int = 1
    step: int = 0                   # micro-batches since the window opened
    sync_gradients: bool = True     # True on the micro-batch that closes a window
    end_of_dataloader: bool = False  # the last yielded batch was its loader's last
    # the prepared optimizers' verdicts on their last step (fp16: skipped on inf/NaN)
    step_skipped: List[Callable[[], bool]] = field(default_factory=list)
    # the Accelerator's record of the prepared loaders being iterated (`ActiveLoaders`), and the
    # end flag each running loader reported last (an inner loop's end is not the outer loop's)
    loaders: Optional[Any] = field(default=None, repr=False, compare=False)
    _ends: Dict[int, bool] = field(default_factory=dict, repr=False, compare=False)

    @property
    def active_dataloader(self) -> Optional[Any]:
        """The prepared loader being iterated (the innermost of nested loops), None outside any
        (Accelerate's ``GradientState.active_dataloader``)."""
        return self.loaders.innermost() if self.loaders is not None else None

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared loader is being iterated (Accelerate's ``GradientState.in_dataloader``)."""
        return self.active_dataloader is not None

    def advance(self) -> None:
        """One more micro-batch: close the window on the N-th one or at a loader's end."""
        if self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.num_steps == 0
            if self.sync_gradients:
                self.step = 0

    def saw_batch(self, last: bool) -> None:
        """Called by a prepared loader as it yields a batch (``last``: its final one)."""
        self.end_of_dataloader = bool(last)
        if self.active_dataloader is not None:
            self._ends[id(self.active_dataloader)] = bool(last)

    def left_loader(self, loader: Any) -> None:
        """A prepared loader's iteration ended: inside an outer loop, ``end_of_dataloader`` is the
        outer loader's again (Accelerate reads it from the active loader)."""
        self._ends.pop(id(loader), None)
        outer = self.active_dataloader
        if outer is not None:
            self.end_of_dataloader = self._ends.get(id(outer), False)

    @property
    def optimizer_step_skipped(self) -> bool:
        """True when some prepared optimizer skipped its last step (fp16 overflow)."""
        return any(skipped() for skipped in self.step_skipped)

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "num_steps": self.num_steps}

    def check_state_dict(self, state: Dict[str, Any], saved_processes: int, processes: int) -> None:
        """Raise `ValueError` when ``state`` cannot be resumed by ``processes`` processes; it was
        saved by ``saved_processes``. Inside an open accumulation window the gradients so far
        belong to micro-batches of ``saved_processes`` x the batch size: with another process
        count the window would close on other samples than any run's, so that is refused."""
        saved = int(state["num_steps"])
        if saved != self.num_steps:
            raise ValueError(f"the checkpoint was saved with gradient_accumulation_steps={saved}; this run uses "
                             f"{self.num_steps}. Resume with the same value")
        step = int(state["step"])
        if step and saved_processes != processes:
            raise ValueError(
                f"the checkpoint was saved inside an open gradient-accumulation window ({step} of {saved} "
                f"micro-batches) by {saved_processes} processes; their gradients so far cannot be split over "
                f"{processes} processes. Resume it with {saved_processes} processes, or save where "
                "accelerator.sync_gradients is True (after an optimizer step)"
            )

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = int(state["num_steps"])
        if saved != self.num_steps:
            raise ValueError(f"the checkpoint was saved with gradient_accumulation_steps={saved}; this run uses "
                             f"{self.num_steps}. Resume with the same value")
        self.step = int(state["step"])
        self.sync_gradients = self.step == 0


@dataclass(frozen=True)
class LoopSettings:
    """What a backend's prepared objects need to know of the loop (given before any prepare)."""

    mixed_precision: str
    gradients: GradientState
    num_processes: int
    # Accelerate's ``step_scheduler_with_optimizer``: False steps a prepared scheduler once per
    # ``step()`` call, whatever the optimizer did
    step_scheduler_with_optimizer: bool = True
    # from ``kwargs_handlers`` (`unified.compat.kwargs_handlers`): the fields that differ from their
    # defaults, for the framework's data-parallel wrapper, loss scaler and autocast
    data_parallel_options: Dict[str, Any] = field(default_factory=dict)
    loss_scaler_options: Dict[str, Any] = field(default_factory=dict)
    autocast_options: Dict[str, Any] = field(default_factory=dict)


def scheduler_steps(settings: LoopSettings) -> int:
    """How many times a prepared LR scheduler's ``step()`` steps the user's scheduler now.

    As in Accelerate: 0 between accumulation boundaries and after an optimizer step skipped on
    overflow; else ``num_processes`` (each process sees 1/num_processes of the batches, so a
    schedule sized from the un-prepared loader ends where the user expects). With
    ``step_scheduler_with_optimizer=False``: 1, always (the user steps the schedule as they see
    fit). Accelerate's ``split_batches``, which steps once, is refused by the Accelerator.

    Example:
        >>> scheduler_steps(LoopSettings("no", GradientState(), num_processes=2))
        2
    """
    if not settings.step_scheduler_with_optimizer:
        return 1
    if not settings.gradients.sync_gradients or settings.gradients.optimizer_step_skipped:
        return 0
    return settings.num_processes
