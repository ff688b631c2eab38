"""Placing the next batches in a background thread while the current step runs.

`prefetched` runs a producer (collate and place on devices) up to ``depth`` items ahead of its
consumer, through a bounded queue. Nothing about a loader's position moves in the producer: the
loader counts a batch as consumed only when it hands it out, so a checkpoint taken meanwhile
resumes at the first batch the training loop has not seen (prefetched ones are produced again).
"""
from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

_POLL_S = 0.1  # how often a blocked producer looks whether the consumer has gone
_JOIN_S = 30.0  # how long closing waits for the producer to finish its current item


class _End:
    def __init__(self, error: BaseException = None) -> None:
        self.error = error


def prefetched(items: Iterable[T], depth: int) -> Iterator[T]:
    """Yield ``items`` in order, produced by a daemon thread at most ``depth`` items ahead.

    An exception of the producer is raised here, at the item where it happened. Closing the
    generator (a ``break`` in the loop) stops the producer after its current item and waits for
    it, so no placement outlives the loop.

    Example:
        >>> list(prefetched(range(5), depth=2))
        [0, 1, 2, 3, 4]
    """
    if depth < 1:
        yield from items
        return
    ready: "queue.Queue[object]" = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_End())
        except BaseException as err:  # handed to the consumer, raised there
            put(_End(err))

    worker = threading.Thread(target=produce, name="unified-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item = ready.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        stop.set()
        worker.join(_JOIN_S)
        close = getattr(items, "close", None)
        if close is not None and not worker.is_alive():
            close()
