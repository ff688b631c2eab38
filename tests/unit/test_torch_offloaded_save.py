"""``save_model`` of a model that Accelerate's ``load_checkpoint_and_dispatch`` offloaded to disk
(parameters on the meta device, weights behind ``AlignDevicesHook``s): Accelerate 1.15's own
``test_save_model_offload``, run on unified's Accelerator (issue 50). Before, unified raised
``NotImplementedError: Cannot copy out of meta tensor``. A meta model with no hook is a clear error."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

from unified import Accelerator  # noqa: E402


class ModelForTest(torch.nn.Module):  # Accelerate's tests/test_accelerator.py model
    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(3, 4)
        self.batchnorm = torch.nn.BatchNorm1d(4)
        self.linear2 = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_save_model_of_a_model_offloaded_to_disk(tmp_path, use_safetensors):
    torch.manual_seed(0)
    accelerator = Accelerator(backend="torch")
    device_map = {"linear1": "disk", "batchnorm": "cpu", "linear2": "disk"}
    model = ModelForTest().eval()
    inputs = torch.randn(3, 3)
    expected = model(inputs)
    accelerator.save_model(model, str(tmp_path), safe_serialization=use_safetensors)
    accelerate.load_checkpoint_and_dispatch(model, str(tmp_path), device_map=device_map,
                                            offload_folder=str(tmp_path / "offload"))
    assert any(p.device.type == "meta" for p in model.parameters())  # really offloaded
    accelerator.save_model(model, str(tmp_path), safe_serialization=use_safetensors)
    fresh = ModelForTest().eval()
    accelerate.load_checkpoint_and_dispatch(fresh, str(tmp_path))
    assert torch.allclose(expected, fresh(inputs), atol=1e-5)
    accelerator.end_training()


def test_a_meta_model_without_weights_is_a_clear_error(tmp_path):
    accelerator = Accelerator(backend="torch")
    with torch.device("meta"):
        model = ModelForTest()
    with pytest.raises(RuntimeError, match="meta device and no offload hook.*meta-device-model"):
        accelerator.save_model(model, str(tmp_path))
    accelerator.end_training()
