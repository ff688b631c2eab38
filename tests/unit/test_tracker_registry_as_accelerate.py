"""A script that switched ``from accelerate.tracking import GeneralTracker, register_tracker_class``
to ``unified.tracking`` (issue 50): the registered class is reached by its exact ``name`` through
``log_with``, ``init_kwargs``, ``log_kwargs`` and ``get_tracker``, with the same calls as in
Accelerate 1.15; ``log_with="all"`` starts the available built-in trackers only (Accelerate's
``get_available_trackers()``), never a registered class."""
from __future__ import annotations

import pytest

from unified.tracking import registry

from .memory_backend import MemoryGroup


@pytest.fixture
def registered():
    """The registry as it was before the test (registering changes a module-wide dict)."""
    before = dict(registry.TRACKERS)
    yield
    registry.TRACKERS.clear()
    registry.TRACKERS.update(before)


def _tracker_class(base, seen):
    class MyTracker(base):
        name = "MyTracker"
        requires_logging_directory = False

        def __init__(self, run_name, **kwargs):
            super().__init__()
            seen.append(("init", run_name, kwargs))

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            seen.append(("config", values))

        def log(self, values, step=None, **kwargs):
            seen.append(("log", values, step, kwargs))

        def finish(self):
            seen.append(("finish",))

    MyTracker.main_process_only = False  # Accelerate's: run it here without a PartialState
    return MyTracker


def _script(accelerator):
    accelerator.init_trackers("proj", config={"lr": 0.1}, init_kwargs={"MyTracker": {"entity": "me"}})
    accelerator.log({"loss": 0.5}, step=3, log_kwargs={"MyTracker": {"commit": True}})
    found = accelerator.get_tracker("MyTracker")
    accelerator.end_training()
    return type(found).__name__


def test_a_registered_tracker_is_reached_by_its_exact_name_as_in_accelerate(registered, monkeypatch):
    from unified.tracking import GeneralTracker, register_tracker_class

    ours = []
    register_tracker_class(_tracker_class(GeneralTracker, ours))
    assert _script(MemoryGroup(1).accelerator(0, log_with="MyTracker")) == "MyTracker"

    accelerate_tracking = pytest.importorskip("accelerate.tracking")
    from accelerate import Accelerator as AccelerateAccelerator

    theirs = []
    monkeypatch.setattr(accelerate_tracking, "LOGGER_TYPE_TO_CLASS", dict(accelerate_tracking.LOGGER_TYPE_TO_CLASS))
    accelerate_tracking.register_tracker_class(_tracker_class(accelerate_tracking.GeneralTracker, theirs))
    monkeypatch.setattr("accelerate.accelerator.LOGGER_TYPE_TO_CLASS", accelerate_tracking.LOGGER_TYPE_TO_CLASS)
    assert _script(AccelerateAccelerator(log_with="MyTracker")) == "MyTracker"
    assert ours == theirs == [("init", "proj", {"entity": "me"}), ("config", {"lr": 0.1}),
                              ("log", {"loss": 0.5}, 3, {"commit": True}), ("finish",)]


def test_all_starts_the_available_built_in_trackers_only(registered, tmp_path):
    from unified.tracking import GeneralTracker, available_trackers, get_available_trackers, register_tracker_class

    register_tracker_class(_tracker_class(GeneralTracker, []))
    resolved = registry.resolve_log_with("all", str(tmp_path))
    assert "MyTracker" not in resolved and "MyTracker" not in available_trackers()
    assert resolved == available_trackers() == [str(t) for t in get_available_trackers()]
    assert set(resolved) <= {"tensorboard", "mlflow", "wandb"}

    accelerate_tracking = pytest.importorskip("accelerate.tracking")
    theirs = {str(t) for t in accelerate_tracking.filter_trackers("all", str(tmp_path))}
    assert set(resolved) == theirs & {"tensorboard", "mlflow", "wandb"}
