"""The torch backend on one CUDA device: device selection, the CUDA random generator in
checkpoints, the fp16 loss scaler and bf16 autocast on CUDA, async saves that copy device memory
to pinned host memory without blocking and never save a value a later step changed, loads onto
the device, and ``save_model`` of a model on the device."""
from __future__ import annotations

import time

import pytest

from .conftest import needs_cuda

torch = pytest.importorskip("torch")
pytestmark = needs_cuda


@pytest.fixture
def accelerator():
    from unified import Accelerator

    acc = Accelerator(backend="torch")
    yield acc
    acc.end_training()


def _model(width: int = 64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                               torch.nn.Linear(width, 8))


def _step(acc, model, optimizer, width: int = 64) -> None:
    x = torch.randn(16, width, device=acc.device)
    loss = model(x).float().pow(2).mean()
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def test_the_process_runs_on_its_local_cuda_device(accelerator):
    acc = accelerator
    assert acc.device == torch.device("cuda", acc.local_process_index % torch.cuda.device_count())
    assert torch.cuda.current_device() == acc.device.index
    model, optimizer = acc.prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    assert {p.device for p in model.parameters()} == {acc.device}
    loader = acc.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2))
    assert next(iter(loader))[0].device == acc.device  # batches arrive on the device


def test_the_cuda_generator_resumes_exactly(accelerator, tmp_path):
    acc = accelerator
    model, optimizer = acc.prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    path = acc.save_state(str(tmp_path / "ckpt"))
    drawn = torch.randn(1000, device=acc.device)
    dropped = model(torch.ones(4, 64, device=acc.device))  # dropout draws on the device
    acc.load_state(path)
    assert torch.equal(torch.randn(1000, device=acc.device), drawn)
    assert torch.equal(model(torch.ones(4, 64, device=acc.device)), dropped)


def test_the_fp16_loss_scale_is_checkpointed_on_cuda(tmp_path):
    from unified import Accelerator

    acc = Accelerator(backend="torch", mixed_precision="fp16")
    try:
        model = _model()
        model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
        for _ in range(3):
            _step(acc, model, optimizer)
        scaler = acc.scaler
        assert scaler is not None and scaler.is_enabled() and scaler.get_scale() > 0
        saved = scaler.get_scale()
        path = acc.save_state(str(tmp_path / "ckpt"))
        scaler.update(new_scale=saved / 1024)
        acc.load_state(path)
        assert acc.scaler.get_scale() == saved
    finally:
        acc.end_training()


def test_bf16_autocast_computes_in_bf16_on_cuda():
    from unified import Accelerator

    acc = Accelerator(backend="torch", mixed_precision="bf16")
    try:
        model = acc.prepare(_model())
        seen = {}
        inner = acc.unwrap_model(model)[0]
        handle = inner.register_forward_hook(lambda module, args, out: seen.update(dtype=out.dtype))
        out = model(torch.ones(2, 64, device=acc.device))
        handle.remove()
        assert seen["dtype"] == torch.bfloat16 and out.dtype == torch.float32  # as Accelerate: float32 out
        with acc.autocast():
            assert (torch.ones(2, 2, device=acc.device) @ torch.ones(2, 2, device=acc.device)).dtype == torch.bfloat16
    finally:
        acc.end_training()


def test_an_async_save_keeps_the_device_state_of_its_moment(accelerator, tmp_path):
    """The copies run on a stream of their own into pinned memory; the call does not wait for
    them, and the steps right after it (which change every saved tensor in place on the device)
    run after the copies on the device, so the checkpoint holds the values of the save's moment."""
    acc = accelerator
    width = 2048  # 16 MB per layer: copies that take measurable time
    model = _model(width)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.5))
    _step(acc, model, optimizer, width)
    expected = {k: v.detach().cpu().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    torch.cuda.synchronize()
    started = time.perf_counter()
    acc.save_state(str(tmp_path / "ckpt"), async_save=True)
    blocked = time.perf_counter() - started
    for _ in range(3):
        _step(acc, model, optimizer, width)
    acc.wait_for_checkpoint()
    changed = {k: v.detach().cpu() for k, v in acc.unwrap_model(model).state_dict().items()}
    assert any(not torch.equal(changed[k], expected[k]) for k in expected)  # the steps really changed them
    acc.load_state(str(tmp_path / "ckpt"))
    for name, value in acc.unwrap_model(model).state_dict().items():
        assert value.device == acc.device, name  # loaded onto the device
        assert torch.equal(value.cpu(), expected[name]), name
    print(f"async save of {sum(v.numel() * v.element_size() for v in expected.values()) / 1e6:.0f} MB "
          f"of device state blocked {blocked * 1e3:.1f} ms")


def test_save_model_writes_device_weights_that_load_on_cpu(accelerator, tmp_path):
    from safetensors.torch import load_file

    acc = accelerator
    model = acc.prepare(_model())
    folder = acc.save_model(model, str(tmp_path / "weights"))
    import glob
    import os

    files = glob.glob(os.path.join(str(tmp_path / "weights"), "*.safetensors"))
    assert files, folder
    loaded = {}
    for path in files:
        loaded.update(load_file(path, device="cpu"))
    for name, value in acc.unwrap_model(model).state_dict().items():
        assert torch.equal(loaded[name], value.cpu()), name


def test_a_load_fills_the_device_tensors_in_place_without_a_host_copy_of_the_state(accelerator, tmp_path):
    """Issue 29: a load reads each large tensor on the GPU through one staging buffer into the
    tensor itself (same memory), instead of reading the whole state into host memory first."""
    import json
    import subprocess
    import sys
    import textwrap

    acc = accelerator
    model = acc.prepare(torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)]))  # 384 MiB
    optimizer = acc.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
    _step(acc, model, optimizer, width=2048)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    moment = optimizer.state[model[0].weight]["exp_avg"]
    saved_moment, addresses = moment.clone(), (model[0].weight.data_ptr(), moment.data_ptr())
    acc.save_state(str(tmp_path / "ckpt"))
    _step(acc, model, optimizer, width=2048)
    acc.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert torch.equal(optimizer.state[model[0].weight]["exp_avg"], saved_moment)
    assert (model[0].weight.data_ptr(), optimizer.state[model[0].weight]["exp_avg"].data_ptr()) == addresses
    _step(acc, model, optimizer, width=2048)  # trains on

    script = tmp_path / "peak.py"  # a fresh process's host memory during the load alone
    script.write_text(textwrap.dedent("""
        import json, sys, torch
        from unified import Accelerator

        def status(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

        acc = Accelerator(backend="torch")
        layers = [torch.nn.Linear(2048, 2048, device=acc.device) for _ in range(24)]  # never whole on the host
        model = acc.prepare(torch.nn.Sequential(*layers))
        optimizer = acc.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
        acc.backward(model(torch.ones(2, 2048, device=acc.device)).sum())
        optimizer.step()  # the moments exist on the device, as in a run that resumes after its first step
        torch.cuda.synchronize()
        before = status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        acc.load_state(sys.argv[1])
        print(json.dumps({"before": before, "peak": status("VmHWM")}))
    """))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], check=True, timeout=300,
                         capture_output=True, text=True).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    state = 3 * 24 * (2048 * 2048 + 2048) * 4  # parameters and two Adam moments: 1.1 GiB
    assert measured["peak"] - measured["before"] < state // 4, measured
