"""JAX's lines of ``unified env``."""
from __future__ import annotations

from typing import List


def report() -> List[str]:
    """The devices JAX sees on this host."""
    import jax

    return [f"- jax devices: {', '.join(str(d) for d in jax.local_devices())}"]
