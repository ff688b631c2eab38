"""Accelerate's save/load-state pre hooks (issue 24): ``register_save_state_pre_hook`` hooks
write into the checkpoint before unified's files and their files are committed and verified
with it; a model whose weights a hook removes is saved by the hook (diffusers'
``save_model_hook``) and restored by a load hook; handles remove their hook."""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from unified import CheckpointError  # noqa: E402


def _prepared(acc):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    return acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_hook_files_are_committed_and_verified(tmp_path, torch_accelerator):
    model, _ = _prepared(torch_accelerator)
    seen = {}

    def save_config(models, weights, output_dir):
        seen["save"] = (models == [model], len(weights), os.path.basename(output_dir))
        with open(os.path.join(output_dir, "data.json"), "w") as handle:
            json.dump({"class_name": type(models[0]).__name__}, handle)

    def load_config(models, input_dir):
        with open(os.path.join(input_dir, "data.json")) as handle:
            models[0].class_name = json.load(handle)["class_name"]

    save = torch_accelerator.register_save_state_pre_hook(save_config)
    load = torch_accelerator.register_load_state_pre_hook(load_config)
    path = torch_accelerator.save_state(str(tmp_path / "ckpt"))
    assert seen["save"][:2] == (True, 1) and seen["save"][2].startswith(".ckpt.tmp-")  # before the commit
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["hook_files"] == ["data.json"] and "data.json" in manifest["files"]
    torch_accelerator.load_state(path)
    assert model.class_name == "Linear"
    torch_accelerator.save_state(path)  # the folder holds only what checkpoints wrote: it may be replaced
    (tmp_path / "ckpt" / "data.json").write_text('{"class_name": "tampered"}')
    with pytest.raises(CheckpointError, match="data.json"):
        torch_accelerator.load_state(path)  # verified before the load hook reads it
    save.remove()
    load.remove()
    model.class_name = "kept"
    torch_accelerator.save_state(str(tmp_path / "plain"))
    torch_accelerator.load_state(str(tmp_path / "plain"))
    assert model.class_name == "kept" and not (tmp_path / "plain" / "data.json").exists()


def test_a_model_saved_by_hooks_is_restored_by_hooks(tmp_path, torch_accelerator):
    model, optimizer = _prepared(torch_accelerator)

    def save_model_hook(models, weights, output_dir):  # as diffusers' training scripts
        if torch_accelerator.is_main_process:
            for one in models:
                torch.save(one.state_dict(), os.path.join(output_dir, "own_weights.pt"))
                weights.pop()

    def load_model_hook(models, input_dir):
        while models:
            one = models.pop()
            one.load_state_dict(torch.load(os.path.join(input_dir, "own_weights.pt"), weights_only=True))

    torch_accelerator.register_save_state_pre_hook(save_model_hook)
    path = torch_accelerator.save_state(str(tmp_path / "ckpt"))
    names = sorted(os.listdir(path))
    assert "own_weights.pt" in names and "model_0.safetensors" not in names and "optimizer_0.safetensors" in names
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(CheckpointError, match="model_0 was saved by a save-state hook"):
        torch_accelerator.load_state(path)
    assert not torch.equal(model.weight, saved["weight"])  # nothing restored
    handle = torch_accelerator.register_load_state_pre_hook(load_model_hook)
    torch_accelerator.load_state(path)
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    handle.remove()
