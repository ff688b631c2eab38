"""Experiment trackers: `log_with` choices and their errors, the tracker protocol on the main
process only, values brought to the host, and tensorboardX without torch. The real trackers'
files are checked in real groups by unified/testing/suite/test_data.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import unified.accelerator as accelerator_module
from unified import Accelerator, ProjectConfiguration
from unified.tracking import GeneralTracker, LoggerType, TrackerUnavailable, available_trackers
from unified.tracking.base import NoOpTracker
from unified.tracking.registry import resolve_log_with, to_host
from unified.utils import LoggerType as UtilsLoggerType

from .memory_backend import MemoryGroup, run_threads, unwrap

REPO = Path(__file__).resolve().parents[2]


class RecordingTracker(GeneralTracker):
    """A tracker of one's own, as a user writes it: records every call."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append(("start",))

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def no_backend(monkeypatch):
    """Tracker arguments are checked before a backend is created (before joining a group)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a backend was created before log_with was checked")

    monkeypatch.setattr(accelerator_module, "create_backend", refuse)


def test_a_missing_package_names_the_extra_before_joining_the_group(no_backend, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec gives None
    with pytest.raises(TrackerUnavailable, match=r"log_with='wandb' needs the package\(s\) wandb") as info:
        Accelerator(log_with=["tensorboard", "wandb"] if "tensorboard" in available_trackers() else "wandb",
                    project_dir=tmp_path)
    message = str(info.value)
    assert "pip install 'unified[tracking]'" in message and "docs/troubleshooting.md#tracker-not-installed" in message
    assert isinstance(info.value, ImportError)
    assert "wandb" not in available_trackers()  # and "all" leaves it out instead of failing


@pytest.mark.parametrize("bad", ["tensorbord", "comet_ml", 3, ["mlflow", None]])
def test_an_unknown_tracker_is_a_value_error_listing_the_choices(no_backend, bad, monkeypatch):
    # ["mlflow", None]: None is the error
    monkeypatch.setattr("unified.tracking.registry._installed", lambda module: True)
    with pytest.raises(ValueError,
                       match=r"Unsupported tracker in log_with: .*'tensorboard', 'mlflow', 'wandb', 'all'") as info:
        Accelerator(log_with=bad, project_dir="unused")
    assert str(info.value).endswith("docs/troubleshooting.md#unknown-tracker")


def test_tensorboard_needs_a_logging_directory(no_backend, monkeypatch):
    monkeypatch.setattr("unified.tracking.registry._installed", lambda module: True)
    with pytest.raises(ValueError,
                       match=r"Logging with 'tensorboard' needs a logging directory.*#tracker-needs-logging-dir"):
        Accelerator(log_with=LoggerType.TENSORBOARD)


def test_names_enum_all_and_the_logging_directory_resolve_as_in_accelerate(monkeypatch):
    monkeypatch.setattr("unified.tracking.registry._installed", lambda module: module != "wandb")
    custom = RecordingTracker()
    assert resolve_log_with(None, None) == []
    assert resolve_log_with("all", "logs") == ["tensorboard", "mlflow"]              # every installed one
    assert resolve_log_with(["MLflow", LoggerType.MLFLOW, custom], None) == ["mlflow", custom]
    assert resolve_log_with([custom, "all"], "logs") == ["tensorboard", "mlflow", custom]
    assert UtilsLoggerType is LoggerType and LoggerType.ALL == "all" and str(LoggerType.WANDB) == "wandb"
    # logging_dir: ProjectConfiguration's, else project_dir (checked when the Accelerator is made)
    group = MemoryGroup(1)
    with pytest.raises(ValueError, match="needs a logging directory"):
        group.accelerator(0, log_with="tensorboard", project_config=ProjectConfiguration())
    acc = group.accelerator(0, log_with="tensorboard", project_config=ProjectConfiguration(logging_dir="tb"))
    assert acc.logging_dir == "tb"


def test_a_custom_tracker_without_the_interface_is_refused():
    class Incomplete(GeneralTracker):
        pass

    with pytest.raises(NotImplementedError,
                       match=r"must define `name`, `requires_logging_directory`, `tracker`.*#custom-tracker"):
        Incomplete()


def test_the_main_process_starts_logs_and_finishes_the_others_do_nothing(tmp_path):
    group = MemoryGroup(2)
    trackers = [RecordingTracker(), RecordingTracker()]  # each process builds its own, as a script does

    def body(rank):
        acc = group.accelerator(rank, log_with=[trackers[rank]], project_dir=str(tmp_path))
        acc.log({"early": 1.0})                                 # before init_trackers: nothing
        acc.init_trackers("proj", config={"lr": 0.1})
        acc.log({"loss": np.float32(0.5), "n": np.array(3), "vec": np.arange(3), "text": "hi",
                 "group": {"a": np.array([2.5])}}, step=7, log_kwargs={"recording": {"commit": False}})
        got, raw = acc.get_tracker("recording"), acc.get_tracker("recording", unwrap=True)
        started = [t.name for t in acc.trackers]
        acc.end_training()
        return got, raw, started

    (main_got, main_raw, main_started), (other_got, other_raw, other_started) = unwrap(
        run_threads(2, body, group=group))
    main, other = trackers
    assert main.calls[:2] == [("start",), ("config", {"lr": 0.1})]
    kind, values, step, kwargs = main.calls[2]
    assert (kind, step, kwargs) == ("log", 7, {"commit": False})
    assert values["loss"] == 0.5 and type(values["loss"]) is float      # one-element arrays: Python numbers
    assert values["n"] == 3 and type(values["n"]) is int
    assert isinstance(values["vec"], np.ndarray) and values["vec"].tolist() == [0, 1, 2]
    assert values["text"] == "hi" and values["group"] == {"a": 2.5}
    assert main.calls[3:] == [("finish",)]                              # end_training closed it, once
    assert main_got is main and main_raw is main.calls and main_started == ["recording"]
    assert other.calls == [] and other_started == []                    # nothing on the other process
    assert isinstance(other_got, NoOpTracker) and isinstance(other_raw, NoOpTracker) and other_got.name == "recording"
    other_got.log({"x": 1}, step=1)                                     # whose calls do nothing


def test_get_tracker_of_an_unknown_name_and_init_trackers_twice(tmp_path):
    acc = MemoryGroup(1).accelerator(0, log_with=[RecordingTracker()])
    assert isinstance(acc.get_tracker("recording"), NoOpTracker)      # before init_trackers, as in Accelerate
    acc.init_trackers("proj")
    with pytest.raises(ValueError,
                       match=r"'tensorboard' is not a tracker of this Accelerator; its trackers: 'recording'"):
        acc.get_tracker("tensorboard")
    with pytest.raises(RuntimeError, match=r"init_trackers\(\) was already called.*#init-trackers-twice"):
        acc.init_trackers("proj")
    plain = MemoryGroup(1).accelerator(0)
    plain.init_trackers("proj")                                         # log_with=None: nothing to start
    plain.log({"loss": 1.0})
    assert plain.trackers == [] and isinstance(plain.get_tracker("wandb", unwrap=True), NoOpTracker)


class FrameworkArray:
    """Stands for a torch tensor / jax.Array: only the backend knows how to bring it to the host."""

    def __init__(self, value):
        self.value = np.asarray(value)


class FakeBackend:
    def is_array(self, value):
        return isinstance(value, FrameworkArray)

    def to_numpy(self, value):
        return value.value.copy()


def test_values_reach_the_trackers_on_the_host_through_the_backend():
    host = to_host({"loss": FrameworkArray(np.float32(0.25)), "one": FrameworkArray([7]),
                    "many": FrameworkArray([1, 2]), "nested": {"acc": FrameworkArray(np.float64(0.5))}, "plain": 3,
                    "text": "t"}, FakeBackend())
    assert host["loss"] == 0.25 and type(host["loss"]) is float
    assert host["one"] == 7 and type(host["one"]) is int
    assert isinstance(host["many"], np.ndarray) and host["many"].tolist() == [1, 2]
    assert host["nested"] == {"acc": 0.5} and host["plain"] == 3 and host["text"] == "t"


def test_tensorboardx_is_imported_without_torch_in_a_process_without_torch():
    pytest.importorskip("tensorboardX")
    code = ("import sys; from unified.tracking.base import import_alone; "
            "writer = import_alone('tensorboardX').SummaryWriter; "
            "assert 'torch' not in sys.modules, 'tensorboardX imported torch'; "
            "import torch; "  # importable afterwards
            "print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


class NamedTracker(GeneralTracker):
    """Registered by name, built as Accelerate builds registered classes: (project_name, **kwargs)."""

    name = "named_tracker"
    requires_logging_directory = False

    def __init__(self, run_name, **kwargs):
        super().__init__()
        self.run_name, self.kwargs, self.config, self.values = run_name, kwargs, {}, {}

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        self.config.update(values)

    def log(self, values, step=None, **kwargs):
        self.values.update(values)


class DuckTracker:
    """Accelerate's GeneralTracker interface without our base class (an accelerate.tracking object)."""

    name = "duck"
    requires_logging_directory = False
    tracker = None

    def __init__(self):
        self.logged = []

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.logged.append("finished")


def test_register_tracker_class_as_accelerate(monkeypatch):
    from unified import tracking

    monkeypatch.setattr(tracking, "TRACKERS", dict(tracking.TRACKERS))
    with pytest.raises(ValueError, match="subclass of `GeneralTracker`"):
        tracking.register_tracker_class(dict)

    class Nameless(GeneralTracker):
        requires_logging_directory = False

    with pytest.raises(ValueError, match="`name`"):
        tracking.register_tracker_class(Nameless)
    tracking.register_tracker_class(NamedTracker)
    with pytest.warns(UserWarning, match="named_tracker"):
        tracking.register_tracker_class(NamedTracker)
    acc = MemoryGroup(1).accelerator(0, log_with=["named_tracker", DuckTracker()])
    acc.init_trackers("project", config={"lr": 0.1}, init_kwargs={"named_tracker": {"entity": "me"}})
    acc.log({"loss": 0.5}, step=3)
    named, duck = acc.get_tracker("named_tracker"), acc.get_tracker("duck")
    acc.end_training()
    assert (named.run_name, named.kwargs, named.config, named.values) == ("project", {"entity": "me"}, {"lr": 0.1},
                                                                          {"loss": 0.5})
    assert duck.logged == [(3, {"loss": 0.5}), "finished"]



def test_trackers_never_move_the_scripts_random_numbers(tmp_path):
    """They run on the main process only: MLflow's start_run draws from Python's random (its run
    names), which moved the main process's training randomness away from the other processes'
    (and a run with trackers away from the same run without; found by tests/test_restarts.py)."""
    import random

    if "mlflow" not in available_trackers():
        pytest.skip("needs the tracking extra: pip install 'unified[tracking]'")
    acc = Accelerator(backend="torch", log_with="mlflow", project_dir=str(tmp_path))
    random.seed(5)
    np.random.seed(5)
    before = (random.getstate(), np.random.get_state()[1].copy())
    acc.init_trackers("rng", config={"lr": 0.1})
    acc.log({"loss": 1.0}, step=0)
    acc.end_training()
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
