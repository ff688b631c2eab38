"""Array names that would collide are refused at save (issue 11, finding 14).

An array's name is the path of keys leading to it, joined by ``/``; ``{"emb/user": a, "emb":
{"user": b}}`` and ``{1: a, "1": b}`` give two arrays one name, and one would silently come
back as the other. `codec.encode` refuses them, and `save_state` says which path.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from unified.checkpoint import codec
from unified.errors import CheckpointError

from .memory_backend import MemoryGroup


@pytest.mark.parametrize("state, path", [
    ({"emb/user": np.zeros(2), "emb": {"user": np.ones(2)}}, "obj/emb/user"),
    ({1: np.zeros(2), "1": np.ones(2)}, "obj/1"),
    ({None: np.zeros(2), "None": np.ones(2)}, "obj/None"),
    ({"a": [np.zeros(1)], "a/0": np.ones(1)}, "obj/a/0"),
])
def test_colliding_array_names_are_refused_at_encode(state, path):
    with pytest.raises(TypeError, match=path):
        codec.encode(state, lambda x: False, "obj")


def test_keys_with_slashes_that_do_not_collide_round_trip():
    state = {"emb/user": np.zeros(2), "emb": {"item": np.ones(2)}, 1: np.full(1, 7.0), "x/1": 3}
    structure, arrays = codec.encode(state, lambda x: False, "obj")
    back = codec.decode(json.loads(json.dumps(structure)), arrays, lambda a: a)
    assert back.keys() == state.keys()
    assert all(np.array_equal(back[k], v) for k, v in state.items())


def test_save_state_refuses_colliding_names_with_a_clear_error(tmp_path):
    class Holder:
        def state_dict(self):
            return {"emb/user": np.zeros(2), "emb": {"user": np.ones(2)}}

        def load_state_dict(self, state):
            pass

    accelerator = MemoryGroup(1).accelerator(0)
    accelerator.register_for_checkpointing(Holder())
    with pytest.raises(CheckpointError, match=r"cannot save custom_checkpoint_0: .*custom_checkpoint_0/emb/user"):
        accelerator.save_state(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
