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

    def __init__(self, work: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self.release: Callable[[], None] = lambda: None  # undoes any write guard (see Backend)
        self._thread = threading.Thread(target=self._run, args=(work,), name="unified-async-save", daemon=False)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._value = work()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            self._error = err

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
