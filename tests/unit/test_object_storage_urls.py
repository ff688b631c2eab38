"""A checkpoint folder given as an object-storage URL is refused with a clear error (issue 29):
before, ``ProjectConfiguration(project_dir="s3://bucket/run")`` and ``save_state("s3://...")``
"succeeded" by writing into a local folder named ``s3:`` in the working directory."""
from __future__ import annotations

import os

import pytest

from unified.config import ProjectConfiguration

URL_ERROR = "object-storage URL.*object-storage-url"


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://bucket/run", "file:///tmp/run"])
def test_project_dir_urls_are_refused(url):
    with pytest.raises(ValueError, match=URL_ERROR):
        ProjectConfiguration(project_dir=url)
    config = ProjectConfiguration()
    with pytest.raises(ValueError, match=URL_ERROR):
        config.set_directories(url)


def test_local_paths_still_work(tmp_path):
    assert ProjectConfiguration(project_dir=tmp_path).project_dir == str(tmp_path)
    assert ProjectConfiguration(project_dir="runs/s3:odd").project_dir == "runs/s3:odd"


def test_save_load_and_save_model_refuse_urls_and_write_nothing(tmp_path, monkeypatch, torch_accelerator):
    import torch

    monkeypatch.chdir(tmp_path)
    model = torch_accelerator.prepare(torch.nn.Linear(2, 2))
    for call in (lambda: torch_accelerator.save_state("s3://bucket/run"),
                 lambda: torch_accelerator.load_state("s3://bucket/run"),
                 lambda: torch_accelerator.save_model(model, "s3://bucket/model")):
        with pytest.raises(ValueError, match=URL_ERROR):
            call()
    assert os.listdir(tmp_path) == []  # no local folder named "s3:"
