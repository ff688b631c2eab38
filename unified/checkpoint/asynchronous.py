"""Background checkpoint writes: the caller continues while files are written and committed."""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional


class AsyncSave:
    """Run ``work`` in a thread; `result` waits for it and re-raises its exception.

    Example:
        >>> pending = AsyncSave(lambda: "done")
        >>> pending.result()
        'done'
    """

    def __init__(self, work: Callable[[], Any], detached: Optional[threading.Event] = None) -> None:
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self.release: Callable[[], None] = lambda: None  # undoes any write guard (see Backend)
        # set by ``work`` once it no longer reads live memory (see `wait_detached`), else when it ends
        self._detached = detached if detached is not None else threading.Event()
        self._thread = threading.Thread(target=self._run, args=(work,), name="unified-async-save", daemon=False)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._value = work()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            self._error = err
        finally:
            self._detached.set()

    def wait_detached(self) -> None:
        """Wait until the work no longer reads the live memory it was given (a write guard's
        wait: in-place updates may go on while the rest is written and committed)."""
        self._detached.wait()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the work to end, without raising its error (that is `result`'s job)."""
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
