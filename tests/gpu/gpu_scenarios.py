"""Scenarios of tests/gpu/test_multi_gpu.py that the conformance suite has in other shapes: sharded
training (FSDP2 on torch, sharded NNX on JAX) saved and loaded back, on the group's GPUs
(checked on CPU groups too when it was written)."""
from __future__ import annotations

import os

import numpy as np

from unified.testing import scenario


@scenario(requires=("ShardedTraining",), kit=("sharded",))
def sharded_round_trip(_: dict) -> dict:
    """Train the kit's sharded setup 2 steps, save, train 1 more, load: the saved parameters
    come back, still split over the processes."""
    from unified.testing.sharding_scenarios import _start, _train

    acc, setup = _start()
    _train(setup, acc, 2)
    saved = setup.full_params()
    path = acc.save_state(os.path.join(os.environ["UNIFIED_TEST_SHARED"], "sharded_round_trip"))
    _train(setup, acc, 1, first=2)
    changed = any(not np.array_equal(saved[name], value) for name, value in setup.full_params().items())
    acc.load_state(path)
    back = all(np.array_equal(saved[name], value) for name, value in setup.full_params().items())
    return {"device": str(acc.device), "changed": changed, "back": back, "layout": setup.layout(),
            "expected_layout": setup.expected_layout(acc.num_processes)}
