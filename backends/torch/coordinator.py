"""Host torch's rendezvous store in its own process: ``python -m backends.torch.coordinator ADDR N``.

A TCPStore beside the workers, as torchrun's agent hosts it (`unified launch` runs torchrun,
whose agent hosts the store itself): the rendezvous service of a torch group started another way,
from `Launcher.service_argv` (the conformance suite's harness does). It serves until it is
stopped (SIGTERM).
"""
from __future__ import annotations

import sys
import time


def serve(address: str, num_processes: int) -> None:
    import torch.distributed as d

    host, port = address.rsplit(":", 1)
    store = d.TCPStore(host, int(port), is_master=True, wait_for_workers=False)  # noqa: F841 - kept until stopped
    time.sleep(1e9)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
