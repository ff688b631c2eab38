"""DTensors in registered state on the torch backend, with or without FSDP: split ones go through
the sharded format (every process its own shards), replicated ones are saved whole, and one the
checkpoint cannot hold (a ``Partial`` sum not yet reduced) is a clear error, not a crash of
process 0 that leaves the others waiting for it."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import unified  # noqa: E402


class Holder:
    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


@pytest.fixture
def one_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("placement", ["Shard", "Replicate"])
def test_a_dtensor_in_registered_state_round_trips(one_process_group, tmp_path, placement):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    kind = Shard(0) if placement == "Shard" else Replicate()
    acc = unified.Accelerator(backend="torch")
    try:
        holder = Holder(DTensor.from_local(torch.arange(6.0).reshape(2, 3), one_process_group, [kind]))
        acc.register_for_checkpointing(holder)
        path = acc.save_state(str(tmp_path / "ckpt"))
        holder.value = DTensor.from_local(torch.zeros(2, 3), one_process_group, [kind])
        acc.load_state(path)
        assert isinstance(holder.value, DTensor) and holder.value.placements == (kind,)
        assert torch.equal(holder.value.to_local(), torch.arange(6.0).reshape(2, 3))
    finally:
        acc.end_training()


def test_a_partial_dtensor_is_a_clear_error(one_process_group, tmp_path):
    from torch.distributed.tensor import DTensor, Partial

    acc = unified.Accelerator(backend="torch")
    try:
        acc.register_for_checkpointing(Holder(DTensor.from_local(torch.ones(2), one_process_group, [Partial()])))
        with pytest.raises(TypeError, match="Partial placement"):  # as for a dtype safetensors cannot hold
            acc.save_state(str(tmp_path / "ckpt"))
    finally:
        acc.end_training()
