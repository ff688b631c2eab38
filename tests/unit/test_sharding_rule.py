"""The JAX placement rule of sharded NNX state (backends/jax/sharding.py) and the one-array-at-a-time
safetensors writer behind save_model of a sharded model."""
import numpy as np
import pytest

from unified.checkpoint import safetensors_io


def test_the_largest_dividing_dimension_is_split_and_annotations_choose_the_candidates():
    pytest.importorskip("jax")
    from backends.jax.sharding import partition_spec, split_dimension

    assert split_dimension((6, 12), 2) == 1          # the largest that divides
    assert split_dimension((12, 6), 3) == 0
    assert split_dimension((8, 8), 2) == 0           # the first of equal ones
    assert split_dimension((5,), 2) is None          # none divides: replicated
    assert split_dimension((), 2) is None            # scalars stay whole
    assert split_dimension((6, 12), 1) is None       # one device: nothing to split
    assert split_dimension((1, 4), 2) == 1 and split_dimension((1,), 2) is None
    assert split_dimension((12, 6), 2, annotation=(None, "model")) == 1   # annotated, though smaller
    assert split_dimension((12, 5), 2, annotation=(None, "model")) is None  # annotated dim does not divide
    assert split_dimension((12, 6), 2, annotation=(None, None)) is None     # annotated as replicated
    assert split_dimension((4, 6, 8), 2, annotation=(("a", "b"), None, "c")) == 2
    assert str(partition_spec((6, 12), 2)) == "P(None, 'data')"
    assert str(partition_spec((5,), 2)) == "P()"


def test_writing_one_array_at_a_time_gives_the_same_file_as_writing_all(tmp_path):
    arrays = {"b": np.arange(5, dtype=np.float32), "a": np.ones((3, 4), np.float64), "c": np.array(7, np.int8)}
    whole = safetensors_io.write(str(tmp_path / "all.safetensors"),
                                 {k: safetensors_io.export_numpy(v) for k, v in arrays.items()})
    asked = []
    specs = {k: (safetensors_io.safetensors_dtype(v.dtype), v.shape) for k, v in arrays.items()}
    one = safetensors_io.write_one_by_one(str(tmp_path / "one.safetensors"), specs,
                                          lambda name: asked.append(name) or arrays[name])
    assert one == whole
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "all.safetensors").read_bytes()
    assert sorted(asked) == sorted(arrays) and len(asked) == 3  # each produced once
    # without a path (a process that only takes part in the gathers): the same order, nothing written
    order = []
    assert safetensors_io.write_one_by_one(None, specs, lambda name: order.append(name) or arrays[name]) is None
    assert order == asked


def test_a_failed_write_still_produces_every_remaining_array(tmp_path):
    arrays = {"a": np.ones(4, np.float32), "b": np.ones(3, np.float32), "c": np.ones(2, np.float32)}
    specs = {k: ("F32", v.shape) for k, v in arrays.items()}
    specs["a"] = ("F32", (5,))  # what produce gives does not fit: ValueError after the first array
    asked = []
    with pytest.raises(ValueError, match="expected F32"):
        safetensors_io.write_one_by_one(str(tmp_path / "x.safetensors"), specs,
                                        lambda name: asked.append(name) or arrays[name])
    assert sorted(asked) == ["a", "b", "c"]  # the other processes' gathers are all met
