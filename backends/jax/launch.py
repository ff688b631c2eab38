"""How a JAX group starts: the launcher hosts JAX's coordination service in a process of its own
(`backends.jax.coordinator`) and tells every worker its place through ``UNIFIED_*`` variables."""
from __future__ import annotations

import sys
from typing import List, Optional

from unified.launcher.plan import Launcher


class CoordinatorLauncher(Launcher):
    """The default launcher, with JAX's coordination service as the rendezvous service."""

    def service_argv(self, address: str, num_processes: int) -> Optional[List[str]]:
        return [sys.executable, "-m", "backends.jax.coordinator", address, str(num_processes)]


LAUNCHER = CoordinatorLauncher()
