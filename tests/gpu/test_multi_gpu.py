"""Groups of 2 processes on 2 GPUs, one each: torch over NCCL (its collectives, a DTensor split
over the GPUs through the sharded checkpoint format, FSDP2 training saved and loaded back), JAX
with its GPU client (an array split over the GPUs through Orbax, sharded NNX training). Skipped
with the reason on fewer GPUs (NCCL refuses two processes on one GPU)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from unified.testing.checkpoint_scenarios import ckpt_sharded
from unified.testing.harness import run_group
from unified.testing.scenarios import collectives, identity, start

from .conftest import jax_gpus, torch_cuda_devices
from .gpu_scenarios import sharded_round_trip

ROOT = Path(__file__).resolve().parents[2]

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


@pytest.mark.parametrize("backend, device_prefix, distributed", CASES)
def test_sharded_training_on_two_gpus_saves_and_loads_back(backend, device_prefix, distributed, tmp_path):
    """FSDP2 (torch) / sharded NNX (JAX) on the GPUs: train, save, train on, load: the saved
    parameters come back, split as before (checked the same way on CPU when this was written)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # the workers import this folder
    group = run_group(backend, 2, [sharded_round_trip], tmp_path, deadline=300, extra_env={"PYTHONPATH": path}).ok()
    rows = group.scenario(sharded_round_trip)
    assert len({r["device"] for r in rows}) == 2 and all(r["device"].startswith(device_prefix) for r in rows), rows
    for r in rows:
        assert r["changed"] and r["back"], r
        assert r["layout"] == r["expected_layout"], r
