"""MLflow as Accelerate's tracker has it (issue 24): ``log_artifact``, ``log_artifacts`` and
``log_kwargs={"mlflow": {...}}`` reaching MLflow, on a local store the test makes."""
from __future__ import annotations

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
