"""``load_state(if_exists=True)`` (issue 26): resume if there is a checkpoint, else start fresh;
a run with nowhere to look for one is a configuration error, not a silent fresh start."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from unified import Accelerator, ProjectConfiguration  # noqa: E402


def test_nothing_yet_then_the_newest(tmp_path):
    acc = Accelerator(backend="torch", project_config=ProjectConfiguration(tmp_path, automatic_checkpoint_naming=True))
    try:
        torch.manual_seed(0)
        model = acc.prepare(torch.nn.Linear(2, 2))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert acc.load_state(if_exists=True) is None
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        saved = acc.save_state()
        with torch.no_grad():
            model.weight.add_(1.0)
        assert acc.load_state(if_exists=True) == saved
        assert torch.equal(model.weight, before["weight"])
        assert acc.load_state(str(tmp_path / "elsewhere"), if_exists=True) is None  # a folder with no checkpoint
    finally:
        acc.end_training()


def test_nowhere_to_look_is_an_error_even_with_if_exists(torch_accelerator):
    torch_accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="load_state\\(\\) needs input_dir"):
        torch_accelerator.load_state(if_exists=True)
