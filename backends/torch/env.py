"""torch's lines of ``unified env`` and its global seeding for `unified.utils.set_seed`."""
from __future__ import annotations

import sys
from typing import List


def report() -> List[str]:
    """The devices torch sees."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"- torch devices: cpu, {gpus} CUDA GPU(s)"]


def seed_globals(seed: int, deterministic: bool = False) -> None:
    """Seed torch's global generators (every CUDA device too) as Accelerate's ``set_seed`` does,
    when torch is already imported; never imports it."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
