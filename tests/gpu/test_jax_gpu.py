"""The JAX backend on a GPU: the process's device is a GPU, prepared state lives there, a save
(sync and async) and a load keep it there with the values of the save's moment."""
from __future__ import annotations

import numpy as np

from .conftest import needs_jax_gpu

pytestmark = needs_jax_gpu


def test_state_stays_on_the_gpu_through_save_and_load(tmp_path):
    import jax

    from unified import Accelerator
    from unified.testing.kit import kit_of

    acc = Accelerator(backend="jax")
    try:
        assert acc.device.platform == "gpu"
        training = kit_of("jax").training(acc)
        training.step()
        leaves = jax.tree_util.tree_leaves(training.nnx.state(training.model))
        assert {d.platform for leaf in leaves for d in leaf.devices()} == {"gpu"}
        saved = training.param_hash()
        acc.save_state(str(tmp_path / "sync"))
        acc.save_state(str(tmp_path / "async"), async_save=True)
        training.step()  # after the call, before the write is done
        acc.wait_for_checkpoint()
        for name in ("sync", "async"):
            training.step()
            acc.load_state(str(tmp_path / name))
            assert training.param_hash() == saved, name
            leaves = jax.tree_util.tree_leaves(training.nnx.state(training.model))
            assert {d.platform for leaf in leaves for d in leaf.devices()} == {"gpu"}, name
            assert all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves
                       if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))
    finally:
        acc.end_training()
