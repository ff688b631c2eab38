"""A flag carried by the outcome of one coordination-service barrier (the JAX `check_trigger`).

Every process waits at the same barrier. An unflagged process names no participants (the
whole group); a flagged one names every process and itself a second time. The service compares
the lists by size, so a flagged arrival fails the barrier with ``INVALID_ARGUMENT: Conflicting
tasks specified ...`` for every caller, those waiting and those still to come (the service
keeps the result and repeats it to a late caller), while a barrier that nobody flagged passes
normally. No flag: one round trip, exactly a plain barrier. Flag: the failure, then one
ordinary barrier so that nobody moves on before everyone has seen it (and a dead peer still
raises `BarrierTimeout` naming it).

Two behaviours of the service (jax 0.10, xla ``coordination_service.cc``) this relies on; the
unit test tests/unit/test_jax_flag_barrier.py checks both against a real service:

* a conflicting participant list fails the barrier with a status we can tell from a timeout;
* a caller that arrives after the barrier failed gets the stored result, provided its
  barrier *counter* is not 0. With recoverable tasks (``jax_enable_recoverability``, which we
  switch on), a call with counter 0 to a barrier that already passed is taken for a restarted
  task and opens a new instance that then waits until its deadline. The client counts calls
  per barrier id, so the backend reuses one barrier id for all its flags and meets there once
  (`prime`) before the first flag.
"""
from __future__ import annotations

from typing import List

# The jax releases whose service was checked to behave as described above (the backend uses the
# two-round-trip protocol, keys then a barrier, with any other).
CHECKED_FROM = (0, 10)

# The start of the service's message for a barrier called with different participant lists.
_CONFLICT = ("INVALID_ARGUMENT", "Conflicting tasks specified")


def flagged_process_ids(num_processes: int, process_index: int) -> List[int]:
    """The participant list a flagged process passes to ``wait_at_barrier``: everyone, and
    itself twice (a list of a different size than the whole group's, that still names only
    members of the group)."""
    return list(range(num_processes)) + [process_index]


def is_flagged(error: BaseException) -> bool:
    """True if ``error`` from ``wait_at_barrier`` says a process arrived with the flagged list."""
    text = str(error)
    return text.startswith(_CONFLICT[0]) and _CONFLICT[1] in text


def supported() -> bool:
    """True if the installed jax is a release this protocol was checked with."""
    import jax

    try:
        return tuple(int(part) for part in jax.__version__.split(".")[:2]) >= CHECKED_FROM
    except ValueError:
        return False
