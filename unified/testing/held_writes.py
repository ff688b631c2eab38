"""A backend's sharded writes held back on a gate, for the async-save scenario of
`unified.testing.sharding_scenarios`."""
from __future__ import annotations

import threading
from typing import Any, Callable


def hold_sharded_writes(acc: Any, gate: threading.Event, seen: dict, fail: bool = False) -> Callable[[], None]:
    """Wrap the backend's `begin_sharded_save` (the real one runs): the write it returns waits
    for ``gate`` before finishing (so that the test acts while nothing is written yet) and, with
    ``fail``, raises an injected disk-full error after writing. ``seen`` gets the folder and the
    thread the write finished on. Returns the function that undoes it."""
    from unified.backend import ShardedWrite

    backend = acc._backend
    real = backend.begin_sharded_save

    def begin(directory, arrays):
        write = real(directory, arrays)
        seen["directory"] = directory

        def held():
            seen["thread"] = threading.current_thread().name
            seen["gate_opened"] = gate.wait(30)
            write.result()
            if fail:
                raise OSError(28, "No space left on device (injected)")

        return ShardedWrite(held)

    backend.begin_sharded_save = begin
    return lambda: setattr(backend, "begin_sharded_save", real)
