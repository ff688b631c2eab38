"""Several JAX processes on one machine each get their own GPUs (issue 14): the split is a
shared rule (unified.runtime.environment), the JAX backend hands it to jax.distributed.initialize as
``local_device_ids``. No GPU is needed: the GPU count and JAX's initialize are stood in for."""
from __future__ import annotations

import doctest

import pytest

import unified.runtime.environment as environment
from unified.runtime.environment import ProcessEnvironment, local_device_share, visible_gpus


def test_the_split_is_equal_contiguous_and_disjoint():
    for gpus in range(0, 17):
        for count in range(1, 9):
            shares = [local_device_share(i, count, gpus) for i in range(count)]
            if count == 1 or gpus < count:
                assert shares == [None] * count
                continue
            flat = [d for share in shares for d in share]
            assert len(flat) == len(set(flat)) == (gpus // count) * count
            assert all(share == list(range(share[0], share[0] + gpus // count)) for share in shares)
            assert max(flat) < gpus


def test_visible_gpus_reads_cuda_visible_devices_before_the_driver(tmp_path):
    (tmp_path / "0000:01:00.0").mkdir()
    (tmp_path / "0000:02:00.0").mkdir()
    assert visible_gpus({}, driver=str(tmp_path)) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3"}, driver=str(tmp_path)) == 1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, driver=str(tmp_path)) == 0
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}, driver=str(tmp_path)) == 2  # -1 ends the list
    assert visible_gpus({}, driver=str(tmp_path / "absent")) == 0


def test_the_docstring_examples_hold():
    assert doctest.testmod(environment, verbose=False).failed == 0


@pytest.mark.parametrize("local,count,gpus,expected", [(1, 2, 8, [4, 5, 6, 7]), (0, 1, 8, None), (2, 4, 2, None)])
def test_the_jax_backend_passes_the_share_to_initialize(monkeypatch, local, count, gpus, expected):
    jax = pytest.importorskip("jax")
    from backends.jax import core

    env = ProcessEnvironment(process_index=local, num_processes=count, local_process_index=local,
                             local_num_processes=count, coordinator="127.0.0.1:1", service_hosted=True)
    for name, value in env.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(core, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(core.private, "coordination_client", lambda: None)
    monkeypatch.setattr(core.private, "configure_recoverable_group", lambda: None)
    seen = {}

    class Stop(Exception):
        pass

    def initialize(**kwargs):
        seen.update(kwargs)
        raise Stop()

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    with pytest.raises(Stop):
        core.JaxBackend().start(timeout=30)
    assert seen.get("local_device_ids") == expected
    assert seen["num_processes"] == count and seen["process_id"] == local
