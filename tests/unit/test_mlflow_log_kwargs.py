"""``accelerator.log(values, step, log_kwargs={"mlflow": {...}})`` (issue 50): Accelerate 1.15's
``MLflowTracker.log(values, step, **kwargs)`` passes ``kwargs`` to ``mlflow.log_metrics``, so any
of its arguments (``timestamp``, ``run_id``, ``synchronous``, ``model_id``, ``dataset``) works; ours
does the same, into the tracker's own store, and the metrics MLflow keeps are the same."""
from __future__ import annotations

import pytest

pytest.importorskip("mlflow")

from unified.tracking import MLflowTracker  # noqa: E402

from .memory_backend import MemoryGroup  # noqa: E402

KWARGS = {"timestamp": 1_700_000_000_123, "synchronous": True}


@pytest.fixture(autouse=True)
def _mlflows_global_store_put_back(monkeypatch):
    """These tests point MLflow's process-wide tracking URI elsewhere; unset it afterwards."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield
    mlflow.set_tracking_uri(None)


def _history(client, run_id, key):
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


def _accelerates_history(tmp_path, monkeypatch):
    """What Accelerate's own MLflowTracker keeps for the same calls (its store is MLflow's global one)."""
    pytest.importorskip("accelerate")
    import mlflow
    from accelerate import PartialState
    from accelerate.tracking import MLflowTracker as AccelerateMLflow

    PartialState(cpu=True)  # one process; Accelerate's logging needs its state

    store = f"sqlite:///{tmp_path / 'accelerate.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    mlflow.set_tracking_uri(store)
    tracker = AccelerateMLflow(experiment_name="exp", logging_dir=str(tmp_path / "accelerate_artifacts"))
    tracker.start()
    try:
        tracker.log({"loss": 0.25, "note": "text"}, step=2, **KWARGS)
        tracker.log({"loss": 0.5}, step=None, timestamp=5)
        run_id = tracker.active_run.info.run_id
    finally:
        mlflow.end_run()
    return _history(mlflow.MlflowClient(store), run_id, "loss")


def test_log_kwargs_reach_mlflow_log_metrics_as_in_accelerate(tmp_path, monkeypatch):
    import mlflow

    tracker = MLflowTracker(experiment_name="exp", logging_dir=str(tmp_path / "logs"))
    acc = MemoryGroup(1).accelerator(0, log_with=tracker)
    acc.init_trackers("exp")
    try:
        acc.log({"loss": 0.25, "note": "text"}, step=2, log_kwargs={"mlflow": KWARGS})
        acc.log({"loss": 0.5}, log_kwargs={"mlflow": {"timestamp": 5}})
    finally:
        acc.end_training()
    run_id, uri = tracker.run_id, tracker.tracking_uri
    ours = _history(mlflow.MlflowClient(uri), run_id, "loss")
    assert ours == [(0, 0.5, 5), (2, 0.25, KWARGS["timestamp"])]
    assert ours == _accelerates_history(tmp_path, monkeypatch)


def test_run_id_logs_into_that_run_of_the_trackers_store_even_after_another_store_was_set(tmp_path, monkeypatch):
    import mlflow

    tracker = MLflowTracker(experiment_name="exp", logging_dir=str(tmp_path / "logs"))
    acc = MemoryGroup(1).accelerator(0, log_with=tracker)
    acc.init_trackers("exp")
    client = mlflow.MlflowClient(tracker.tracking_uri)
    other = client.create_run(client.get_experiment_by_name("exp").experiment_id).info.run_id
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    mlflow.set_tracking_uri(elsewhere)  # the script points MLflow elsewhere meanwhile
    try:
        acc.log({"acc": 0.75}, step=4, log_kwargs={"mlflow": {"run_id": other, "timestamp": 9}})
        assert mlflow.get_tracking_uri() == elsewhere  # and it stays so
        with pytest.raises(TypeError):
            acc.log({"acc": 1.0}, log_kwargs={"mlflow": {"not_an_mlflow_argument": 1}})
    finally:
        acc.end_training()
    assert _history(client, other, "acc") == [(4, 0.75, 9)]
    assert _history(client, tracker.run_id, "acc") == []
