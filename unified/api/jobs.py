"""Running and deferring jobs (`unified.Accelerator`'s part): barriers, main-process-first,
the trigger, preemption, printing once, and the collectives on arrays and objects. Each call is
a collective with the Accelerator's timeout; see docs/api.md."""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Callable, Optional, TypeVar

from ..compat.surface import only_if
from ..errors import see
from ..runtime.preemption import PREEMPTED_EXIT_CODE, record_status

F = TypeVar("F", bound=Callable[..., Any])


class JobControl:
    """Mixed into `unified.Accelerator`: uses its backend, collectives and state."""

    # -- running and deferring jobs ---------------------------------------------------------
    def wait_for_everyone(self, timeout: Optional[float] = None) -> None:
        """Block until every process reached this call (a no-op with one process).

        Raises `unified.BarrierTimeout` naming the missing processes when some process does
        not arrive within ``timeout`` seconds (default: the Accelerator's) or died.

        Example:
            >>> accelerator.wait_for_everyone()
            >>> accelerator.wait_for_everyone(timeout=60)
        """
        self._collectives.barrier("wait_for_everyone", timeout)

    def main_process_first(self) -> "contextlib.AbstractContextManager[None]":
        """Run the body on the main process first, then on the others; all leave together.

        An exception in any process's body reaches the others as `unified.DistributedError`.

        Example:
            >>> with accelerator.main_process_first():
            ...     dataset = prepare_dataset()      # downloads once, others read the cache
        """
        return self._collectives.ordered(self.is_main_process, "main_process_first")

    def local_main_process_first(self) -> "contextlib.AbstractContextManager[None]":
        """Like `main_process_first`, with the first process of each machine going first.

        Example:
            >>> with accelerator.local_main_process_first():
            ...     cache = build_local_cache()
        """
        return self._collectives.ordered(self.is_local_main_process, "local_main_process_first")

    def set_trigger(self) -> None:
        """Raise this process's trigger flag; `check_trigger` reports it on every process.

        Example:
            >>> if loss < target:
            ...     accelerator.set_trigger()
        """
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process, in the same call, if any process called `set_trigger` since
        the last check; resets the flag. A collective: every process must call it equally often.

        With ``handle_preemption``, a preemption signal (`preemption_signals`) received by any process since the last
        check fires it too and sets `preempted` on every process; from then on it returns True
        at every call (the job is going away).

        Example:
            >>> if accelerator.check_trigger():
            ...     accelerator.save_state()
            ...     break
        """
        if self._preempted:  # the same on every process: no collective needed
            self._trigger = False
            return True
        signalled = False
        if self._signals is not None:
            signalled, self._signals_seen = self._signals.consume(self._signals_seen)
        fired = self._collectives.any_flag(self._trigger or signalled, "check_trigger")
        self._trigger = False
        if fired and self._signals is not None:  # was it a preemption? (the same call count everywhere)
            self._preempted = self._collectives.any_flag(signalled, "check_trigger (preemption)")
        return fired

    @property
    def preempted(self) -> bool:
        """True on every process once `check_trigger` reported a preemption signal (one of
        `preemption_signals`, SIGTERM or SIGUSR1 by default, to any process, with ``handle_preemption``).

        Example:
            >>> if accelerator.check_trigger():
            ...     accelerator.save_state()
            ...     if accelerator.preempted:
            ...         print("preempted: saved, exiting for a requeue")
        """
        return self._preempted

    def exit_if_preempted(self) -> None:
        """When `preempted`: finish pending work (`end_training`, unless it ran already) and end
        the process with ``unified.PREEMPTED_EXIT_CODE`` (75, ``EX_TEMPFAIL``), the status a
        requeue script tests (`unified launch` exits with it too when every process did).
        Otherwise, nothing. It raises ``SystemExit``, so ``finally`` blocks and ``atexit`` run.

        Example:
            >>> accelerator = Accelerator(handle_preemption=True, project_dir="run")
            >>> for step, batch in enumerate(loader):
            ...     train_step(batch)
            ...     if accelerator.check_trigger():
            ...         accelerator.save_state()
            ...         break
            >>> accelerator.exit_if_preempted()
        """
        if not self._preempted:
            return
        if not self._ended:
            self.end_training()
        record_status("preempted", self.process_index)
        sys.exit(PREEMPTED_EXIT_CODE)  # an exit status, not a message

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only.

        Example:
            >>> accelerator.print("epoch", 3, "loss", 0.25)
        """
        if self.is_main_process:
            print(*args, **kwargs)

    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the main process only (elsewhere it returns ``None``).

        Example:
            >>> @accelerator.on_main_process
            ... def log(msg):
            ...     print(msg)
        """
        return only_if(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the first process of each machine only.

        Example:
            >>> @accelerator.on_local_main_process
            ... def clean_tmp():
            ...     ...
        """
        return only_if(lambda: self.is_local_main_process, function)

    # -- collectives on arrays ----------------------------------------------------------------
    def gather(self, tree: Any) -> Any:
        """Concatenate every process's arrays along the first axis, on every process.

        Works on framework tensors/arrays and dicts/lists/tuples of them; 0-d values become
        one element per process.

        Example:
            >>> accelerator.gather(torch.tensor([accelerator.process_index]))   # tensor([0, 1])
        """
        return self._collectives.gather(tree)

    def gather_for_metrics(self, tree: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the samples that a prepared loader repeated to even out the end of the
        epoch, so that an evaluation sees each sample exactly once.

        Call it on per-sample values (first axis: the rows of the batch in use) while iterating a
        prepared loader; the innermost loader being iterated decides which gathered rows are
        repeats. On JAX a global ``jax.Array`` sharded over the processes (a prepared batch, a
        jitted step's per-sample output) is already global: the result is its rows without the
        repeats, as a process-local array equal on every process. With ``use_gather_object=True``
        (or a list of values that are not arrays, e.g. strings) it returns one list of the
        per-sample values of every process, without repeats (JSON and arrays; no pickle).

        Example:
            >>> for x, y in eval_loader:            # 10 samples, batch 3, 3 processes
            ...     preds, labels = accelerator.gather_for_metrics((model(x).argmax(-1), y))
            ...     correct += (preds == labels).sum()   # the last batch: 1 sample, not 9
        """
        return self._metrics.gather_for_metrics(tree, use_gather_object)

    def pad_across_processes(self, tree: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad every array of ``tree`` along ``dim`` to its largest size over the processes, with
        ``pad_index`` after the data (before it with ``pad_first``), so that they can be gathered.
        Arrays without axis ``dim`` are returned as they are. A collective.

        Example:
            >>> tokens = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
            >>> tokens = accelerator.gather_for_metrics(tokens)
        """
        return self._metrics.pad_across_processes(tree, dim, pad_index, pad_first)

    def reduce(self, tree: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Element-wise ``"sum"`` or ``"mean"`` over processes, on every process. ``scale`` is
        accepted and, as in Accelerate everywhere but on XLA devices, not applied (a warning says
        so when it is not 1).

        Example:
            >>> accelerator.reduce({"loss": loss}, "mean")
        """
        if scale != 1.0:
            warnings.warn(f"reduce(scale={scale!r}) is ignored, as Accelerate ignores it off XLA devices: multiply "
                          "the result yourself." + see("not-supported-yet"), UserWarning, stacklevel=2)
        return self._collectives.reduce(tree, reduction)

    def broadcast(self, tree: Any, from_process: int = 0) -> Any:
        """Every process receives ``from_process``'s arrays (same shapes on every process).

        Example:
            >>> weights = accelerator.broadcast(weights, from_process=0)
        """
        return self._collectives.broadcast(tree, from_process)

    def gather_object(self, value: Any) -> list:
        """Every process's JSON-serialisable ``value``, in process order (no pickle).

        Example:
            >>> accelerator.gather_object({"rank": accelerator.process_index})
        """
        return self._collectives.all_gather_json(value)
