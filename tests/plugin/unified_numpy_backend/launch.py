"""The default launcher, with a TCP key-value store as the rendezvous service."""
from __future__ import annotations

import sys
from typing import List, Optional

from unified.backend.toolkit import Launcher

_STORE = ("import time, torch.distributed as d; "
          "s = d.TCPStore('{host}', {port}, is_master=True, wait_for_workers=False); time.sleep(1e9)")


class StoreLauncher(Launcher):
    def service_argv(self, address: str, num_processes: int) -> Optional[List[str]]:
        host, port = address.rsplit(":", 1)
        return [sys.executable, "-c", _STORE.format(host=host, port=port)]


LAUNCHER = StoreLauncher()
