"""Checkpoints (`unified.Accelerator`'s part): ``register_for_checkpointing``, ``save_state``,
``wait_for_checkpoint`` and ``load_state``; the work is `unified.checkpoint.manager`'s (its two verbs,
``save`` and ``load``)."""
from __future__ import annotations

from typing import Any, Optional

from ..backend import WriteGuards
from ..errors import CheckpointError, RegistrationError, see


class Checkpointing:
    """Mixed into `unified.Accelerator`: uses its backend, collectives and state."""

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` with every checkpoint; each needs ``state_dict()`` and
        ``load_state_dict()``. Their state may hold arrays, numbers, strings, lists and dicts.

        Raises an error that is both `ValueError` and `TypeError`, listing every offending
        object by position, when some object lacks either method.

        Example:
            >>> accelerator.register_for_checkpointing(scheduler, my_counter)
        """
        bad = [f"\n\t- Item at index {i}, `{_pretty_name(o)}`" for i, o in enumerate(objects)
               if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:  # Accelerate's wording, which its tests and scripts match
            raise RegistrationError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to be stored. "
                "The following inputs are invalid:" + "".join(bad) + see("registration-error")
            )
        for obj in objects:
            self._track("custom_checkpoint", obj, obj.state_dict,
                        lambda state, o=obj: o.load_state_dict(state), managed=False)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   async_save: Optional[bool] = None, **save_model_func_kwargs: Any) -> str:
        """Write models, optimizers, schedulers, scalers, data positions, registered objects and
        every RNG state of every process into a checkpoint directory, atomically.

        With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the directory is
        ``{project_dir}/checkpoints/checkpoint_{iteration}``. ``async_save=True`` returns after
        a host snapshot and writes in the background (see `wait_for_checkpoint`); arrays sharded
        across processes too: every process takes a host copy of its own shards (a collective,
        with the plan of the write) and writes them in the background; the checkpoint is
        committed once every process's files are written.
        ``safe_serialization`` is accepted for Accelerate scripts: files are always safetensors.

        Returns the checkpoint directory.

        Example:
            >>> path = accelerator.save_state()            # automatic naming
            >>> path = accelerator.save_state("ckpt/last")  # an explicit directory
        """
        self.wait_for_checkpoint()
        if async_save is None:
            async_save = self.project_configuration.async_save
        # Where the backend can hold back the next in-place update until the files are written
        # (torch: hooks before a prepared optimizer's step and a prepared model's forward) and
        # detect the others (version counters), the snapshot needs no copy of the framework arrays.
        guard = None
        if isinstance(self._backend, WriteGuards):
            def guard(wait_detached):
                return self._backend.guard_writes(self._prepared.pairs(), wait_detached)
        hooks = self._state_hooks.run_save if self._state_hooks.has_save_hooks else None
        final, self._async_save = self._checkpoints.save(output_dir, async_save=async_save, run_hooks=hooks,
                                                         guard_writes=guard)
        return final

    def wait_for_checkpoint(self) -> None:
        """Block until a background `save_state(async_save=True)` is committed; re-raise its error.

        Example:
            >>> accelerator.save_state(async_save=True)
            >>> accelerator.wait_for_checkpoint()
        """
        pending, self._async_save = self._async_save, None
        if pending is None:
            return
        pending.release()
        error: Optional[BaseException] = None
        try:
            pending.result()
        except BaseException as err:  # noqa: BLE001 - shared with the other processes below
            error = err
        # A collective after the join: the main process has committed when anyone returns, and
        # a failure on any process fails the call everywhere, with every process's reason.
        failed = self._collectives.share_failure(error, "wait_for_checkpoint")
        # folders of their own: each process's retention, once every process committed its folder
        self._checkpoints.finish_background_save(committed=not failed)
        if failed:  # the main process's reason already lists every process's report
            rank, reason = failed[0]
            raise CheckpointError(reason if rank == 0 else f"a background save_state failed on process {rank}: {reason}"
                                  + see("background-save-failed"))

    def load_state(self, input_dir: Optional[str] = None, *, if_exists: bool = False, verify_first: bool = False,
                   **load_kwargs: Any) -> Optional[str]:
        """Restore everything `save_state` wrote, in place, on every process.

        Without ``input_dir`` and with automatic naming, loads the newest checkpoint of
        ``{project_dir}/checkpoints`` that verifies; afterwards the next automatic save never
        collides. A damaged newer one (a checksum mismatch, a missing, truncated or unparseable
        file or manifest, a hostile header, found before or while its arrays are placed) is
        skipped and set aside as ``checkpoint_N.damaged`` (on a store: its manifest moved to
        ``manifest.json.damaged``), never deleted, and the main process warns which one and why;
        every process takes the same decision. Any other failure (the checkpoint does not fit
        this run, a store out of reach) raises as it is. Accelerate's ``map_location``/``strict``
        keywords are accepted. Returns the directory.

        ``if_exists=True``: resume if there is a checkpoint, else start fresh: returns ``None``
        and changes nothing when there is none yet (no complete automatically named checkpoint,
        or no ``manifest.json`` in ``input_dir``), which every process agrees on. With automatic
        naming it skips damaged checkpoints as above. The one line a script restarted by
        ``unified launch --max-restarts`` needs.

        Every byte is read once: the manifest, each file's size and header and every object's
        fit to this run are checked before any object is touched, then the arrays are read into
        place and hashed as they go. Raises `unified.CheckpointError` on every process naming
        the file: for a missing, truncated or mismatched checkpoint before any object is
        modified; for bytes that fail their checksum while they are placed, naming the object as
        well, with the objects holding part of the checkpoint (as after a failed load in
        Accelerate, DCP or Orbax): load again before training; with automatic naming the load
        goes on to the next newest checkpoint, which restores everything. An explicit
        ``input_dir`` always raises (nothing is skipped or set aside then); with automatic
        naming it raises when no checkpoint verifies, naming each one skipped, ``if_exists=True``
        included (starting fresh would silently throw away the training the damaged ones hold).

        ``verify_first=True``: every file is verified whole before any object is restored (the
        large files are read twice), so that a failed load leaves the live state as it was: for
        a script that must go on training its live state when a load fails.

        Example:
            >>> accelerator.load_state()                    # newest checkpoint that verifies
            >>> accelerator.load_state("ckpt/last")         # this one, or CheckpointError
            >>> accelerator.load_state(if_exists=True)      # resume, or start fresh
            >>> accelerator.load_state("ckpt/last", verify_first=True)  # or nothing changes
        """
        unknown = set(load_kwargs) - {"map_location", "strict", "load_kwargs"}
        if unknown:
            raise TypeError(f"load_state() got unexpected keyword argument(s): {', '.join(sorted(unknown))}"
                            + see("load-unexpected-keyword"))
        self.wait_for_checkpoint()
        return self._checkpoints.load(input_dir, self._state_hooks.run_load, if_exists=if_exists,
                                      verify_first=verify_first)


def _pretty_name(obj: Any) -> str:
    """Accelerate's ``get_pretty_name``: a class's or function's own name, else its type's."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)
