"""MLflow as Accelerate's tracker has it (issue 24): ``log_artifact``, ``log_artifacts`` and
``log_kwargs={"mlflow": {...}}`` reaching MLflow, on a local store the test makes."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("mlflow")

from unified.tracking import MLflowTracker  # noqa: E402

from .memory_backend import MemoryGroup  # noqa: E402


def test_artifacts_and_log_kwargs_reach_mlflow(tmp_path):
    import mlflow

    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "a.txt").write_text("a")
    tracker = MLflowTracker(experiment_name="exp", logging_dir=str(tmp_path / "logs"))
    acc = MemoryGroup(1).accelerator(0, log_with=tracker)
    acc.init_trackers("exp")
    tracker.log_artifact(tmp_path / "notes.txt", artifact_path="files")
    tracker.log_artifacts(tmp_path / "plots", artifact_path="plots")
    acc.log({"loss": 0.25}, step=2, log_kwargs={"mlflow": {"synchronous": True}})
    run_id = tracker.run_id
    client = mlflow.MlflowClient(tracker.tracking_uri)
    acc.end_training()
    assert [a.path for a in client.list_artifacts(run_id, "files")] == ["files/notes.txt"]
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/a.txt"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(2, 0.25)]
    with pytest.raises(TypeError):
        tracker.log({"loss": 1.0}, step=3, not_an_mlflow_argument=True)  # passed on, and refused by MLflow


def test_a_run_leaves_the_environment_as_it_was_and_the_next_run_uses_its_own_folder(tmp_path, monkeypatch):
    """MLflow's set_tracking_uri also exports MLFLOW_TRACKING_URI; Accelerate's tracker never sets it,
    and ours must not leave it behind: a second Accelerator (or a process started after the run)
    would otherwise write into the first run's store instead of its own logging_dir."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uris = []
    for name in ("first", "second"):
        tracker = MLflowTracker(experiment_name="exp", logging_dir=str(tmp_path / name))
        acc = MemoryGroup(1).accelerator(0, log_with=tracker)
        acc.init_trackers("exp")
        acc.log({"loss": 1.0}, step=1)
        acc.end_training()
        uris.append(tracker.tracking_uri)
        assert "MLFLOW_TRACKING_URI" not in os.environ, name
    assert str(tmp_path / "first") in uris[0] and str(tmp_path / "second") in uris[1], uris


def test_a_tracking_uri_the_user_exported_is_kept(tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 'users.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    tracker = MLflowTracker(experiment_name="exp", logging_dir=str(tmp_path / "logs"))
    acc = MemoryGroup(1).accelerator(0, log_with=tracker)
    acc.init_trackers("exp")
    acc.end_training()
    assert tracker.tracking_uri == store and os.environ["MLFLOW_TRACKING_URI"] == store
