"""Groups of 2 processes on 2 GPUs, one each: torch over NCCL (its collectives, a DTensor split
over the GPUs through the sharded checkpoint format), JAX with its GPU client (an array split
over the GPUs through Orbax). Skipped with the reason on fewer GPUs (NCCL refuses two processes
on one GPU)."""
from __future__ import annotations

import pytest

from unified.testing.harness import run_group
from unified.testing.scenarios import ckpt_sharded, collectives, identity, start

from .conftest import jax_gpus, torch_cuda_devices

# backend, its devices' names, its distributed_type on GPUs
CASES = [pytest.param("torch", "cuda", "MULTI_GPU", marks=pytest.mark.skipif(torch_cuda_devices() < 2, reason=(
             "needs 2 CUDA devices (NCCL refuses two processes on one GPU); see docs/gpu.md")), id="torch"),
         pytest.param("jax", "cuda", "JAX", marks=pytest.mark.skipif(jax_gpus() < 2, reason=(
             "needs 2 GPUs for JAX; see docs/gpu.md")), id="jax")]


@pytest.mark.parametrize("backend, device_prefix, distributed", CASES)
def test_a_group_of_two_gpus(backend, device_prefix, distributed, tmp_path):
    group = run_group(backend, 2, [start, identity, collectives, ckpt_sharded], tmp_path, deadline=300).ok()
    ids = group.scenario(identity)
    assert [i["distributed_type"].rsplit(".", 1)[-1] for i in ids] == [distributed] * 2, ids
    assert len({i["device"] for i in ids}) == 2 and all(i["device"].startswith(device_prefix) for i in ids), ids
    for r in group.scenario(collectives):
        assert r["objects"] == [{"rank": 0}, {"rank": 1}] and r["sum"] == [2.0, 1.0], r
    for rank, r in enumerate(group.scenario(ckpt_sharded)):
        assert r["mine"] == [[[1.0 + rank] * 3] * 2] and r["sharding_kept"], r
        assert set(r["refused"]) == {"unlisted_file", "link_inside", "files_not_listed"}
        assert all(message for message in r["refused"].values()), r["refused"]
