"""RNG-aware, atomic, pickle-free checkpoints (see docs/checkpoint-format.md)."""
from .manager import CheckpointManager

__all__ = ["CheckpointManager"]
