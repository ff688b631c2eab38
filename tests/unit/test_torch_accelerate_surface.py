"""Accelerate 1.15 names whose meaning is torch's (issue 24): ``prepare_model`` and friends,
``gradient_accumulation_steps`` as a setter, ``unwrap_model(keep_torch_compile=...)``,
``step_scheduler_with_optimizer=False``, ``save`` in torch's format, ``state`` in a group."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from unified import Accelerator  # noqa: E402


def test_prepare_model_and_friends_track_once(torch_accelerator):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    prepared = torch_accelerator.prepare_model(model)
    assert torch_accelerator.prepare_model(prepared) is prepared and len(torch_accelerator._models) == 1
    prepared_optimizer = torch_accelerator.prepare_optimizer(optimizer)
    prepared_scheduler = torch_accelerator.prepare_scheduler(scheduler)
    assert (torch_accelerator._optimizers == [prepared_optimizer]
            and torch_accelerator._schedulers == [prepared_scheduler])
    assert [e.name for e in torch_accelerator._checkpoints.entries] == ["model_0", "optimizer_0", "scheduler_0"]
    with pytest.raises(TypeError, match="not a model"):
        torch_accelerator.prepare_model(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match="evaluation_mode"):
        torch_accelerator.prepare_model(model, evaluation_mode=True)


def test_gradient_accumulation_steps_set_later_divides_the_loss_and_is_checkpointed(torch_accelerator):
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    model = torch_accelerator.prepare(model)
    torch_accelerator.gradient_accumulation_steps = 2
    with torch_accelerator.accumulate(model):
        torch_accelerator.backward(model(torch.ones(1, 1)).sum())
    assert model.weight.grad.item() == pytest.approx(0.5)  # divided by the new steps
    assert "training_loop" in [e.name for e in torch_accelerator._checkpoints.entries]
    with pytest.raises(ValueError, match="integer >= 1"):
        torch_accelerator.gradient_accumulation_steps = 0


def test_unwrap_model_keeps_torch_compile_unless_asked(torch_accelerator):
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(torch.nn.DataParallel(model))
    kept = torch_accelerator.unwrap_model(compiled)
    assert kept is compiled and kept._orig_mod is model  # as Accelerate's keep_torch_compile=True
    assert torch_accelerator.unwrap_model(compiled, keep_torch_compile=False) is model


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_step_scheduler_with_optimizer(with_optimizer):
    acc = Accelerator(backend="torch", gradient_accumulation_steps=2, step_scheduler_with_optimizer=with_optimizer)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(1, 1)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    # with the optimizer: stepped on the 2 boundaries only; without: on each of the 4 calls
    assert scheduler.scheduler.last_epoch == (2 if with_optimizer else 4)
    acc.end_training()


def test_save_in_torch_format_and_as_safetensors(tmp_path, torch_accelerator):
    state = {"w": torch.arange(3.0)}
    torch_accelerator.save(state, tmp_path / "w.bin")
    assert torch.equal(torch.load(tmp_path / "w.bin", weights_only=True)["w"], state["w"])
    torch_accelerator.save(state, tmp_path / "w.safetensors", safe_serialization=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w.safetensors"), "pt") as handle:  # as transformers reads it
        assert handle.metadata() == {"format": "pt"} and torch.equal(handle.get_tensor("w"), state["w"])


def test_get_state_dict_clip_grad_value_and_no_sync(torch_accelerator):
    model = torch.nn.Linear(2, 1)
    model = torch_accelerator.prepare(model)
    state = torch_accelerator.get_state_dict(model)
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], model.weight)
    with torch_accelerator.no_sync(model):  # one process: nothing to hold back, gradients still computed
        torch_accelerator.backward((model(torch.ones(1, 2)) * 100).sum())
    torch_accelerator.clip_grad_value_(model.parameters(), 0.5)
    assert model.weight.grad.abs().max().item() == pytest.approx(0.5)
    assert (torch_accelerator.native_amp is False and torch_accelerator.scaler is None
            and torch_accelerator.is_fsdp2 is False)


def test_reduce_ignores_scale_as_accelerate_does_off_xla(torch_accelerator):
    with pytest.warns(UserWarning, match="ignored"):
        assert torch_accelerator.reduce(torch.tensor([2.0]), "sum", scale=3.0).item() == 2.0


def test_gradient_accumulation_plugin_sets_the_steps():
    from unified.utils import GradientAccumulationPlugin

    acc = Accelerator(backend="torch", gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4))
    assert acc.gradient_accumulation_steps == 4 and acc.gradient_state.num_steps == 4
    acc.end_training()


def test_kwargs_handlers_reach_torch(monkeypatch):
    from backends.torch import core
    from unified.compat.kwargs_handlers import AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs

    seen = {}

    def ddp_init(self, module, **kwargs):  # DDP needs a process group: record what it was given
        seen.update(kwargs)
        torch.nn.Module.__init__(self)
        self.module = module

    monkeypatch.setattr(core._DistributedModel, "__init__", ddp_init)
    acc = Accelerator(backend="torch", mixed_precision="fp16", kwargs_handlers=[
        DistributedDataParallelKwargs(find_unused_parameters=True), GradScalerKwargs(init_scale=1024.0),
        AutocastKwargs(cache_enabled=False)])
    acc._backend.num_processes = 2  # as in a group: prepare wraps the model in DDP
    acc.prepare(torch.nn.Linear(2, 2))
    assert seen["find_unused_parameters"] is True and "bucket_cap_mb" not in seen  # only what differs
    assert acc.scaler.get_scale() == 1024.0 and acc.ddp_handler.find_unused_parameters
    acc._backend.num_processes = 1
    acc.end_training()


def test_autocast_computes_in_the_mixed_precision_outside_a_prepared_forward():
    acc = Accelerator(backend="torch", mixed_precision="bf16")
    try:
        layer, x = torch.nn.Linear(2, 2), torch.ones(1, 2)
        with acc.autocast():
            inside = layer(x)
        assert inside.dtype == torch.bfloat16 and layer(x).dtype == torch.float32
    finally:
        acc.end_training()
    plain = Accelerator(backend="torch")
    try:
        with plain.autocast():  # no mixed precision: nothing changes, as in Accelerate
            assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32
    finally:
        plain.end_training()
