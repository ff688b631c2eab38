"""Host JAX's coordination service in its own process: ``python -m backends.jax.coordinator ADDR N``.

When process 0 hosts the service (JAX's default), its exit or death makes the JAX runtime
abort every other process. The launcher runs the service here instead, like torchrun's agent
hosts the rendezvous store, and stops it after the workers ended (SIGTERM).
"""
from __future__ import annotations

import signal
import sys
import threading


def serve(address: str, num_processes: int, heartbeat_timeout: int = 100) -> None:
    from .private import start_service

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service = start_service(address, num_processes, heartbeat_timeout=heartbeat_timeout, shutdown_timeout=5)
    print(f"coordination service for {num_processes} processes on {address}", flush=True)
    stop.wait()
    service.shutdown()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
