"""One live run per checkpoint folder (issue 11, finding 8): a second run saving into a folder that
another live process holds gets a CheckpointError naming the holder, before anything is written;
Accelerators of one process share the folder; the lock goes with end_training or the process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from unified import CheckpointError, ProjectConfiguration

from .memory_backend import MemoryGroup

ROOT = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from unified.checkpoint import lock; lock.acquire(sys.argv[1]); "
        "print('held', flush=True); time.sleep(60)")


def _accelerator(project):
    config = ProjectConfiguration(str(project), automatic_checkpoint_naming=True)
    return MemoryGroup(1).accelerator(0, project_config=config)


@pytest.fixture
def other_run(tmp_path):
    """Another process holding the lock of tmp_path/project, as another run's main would."""
    folder = tmp_path / "project"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_live_run_is_refused_and_nothing_is_written(tmp_path, other_run):
    acc = _accelerator(tmp_path / "project")
    with pytest.raises(CheckpointError, match=rf"another live run saves checkpoints here .*\"pid\": {other_run.pid}"):
        acc.save_state()
    assert os.listdir(tmp_path / "project") == []  # no checkpoint, no temporary, no lock file
    other_run.kill()
    other_run.wait()  # the kernel drops a dead process's lock: no stale lock after a crash
    assert os.path.basename(acc.save_state()) == "checkpoint_0"


def test_the_lock_adds_nothing_to_the_project_folder(tmp_path):
    """Accelerate's own tests count the project folder's entries (issue 24, regression 2)."""
    acc = _accelerator(tmp_path / "project")
    acc.save_state()
    assert os.listdir(tmp_path / "project") == ["checkpoints"]
    acc.end_training()
    assert os.listdir(tmp_path / "project") == ["checkpoints"]


def test_accelerators_of_one_process_share_the_folder_and_end_training_releases_it(tmp_path):
    first, second = _accelerator(tmp_path / "project"), _accelerator(tmp_path / "project")
    names = [os.path.basename(first.save_state()), os.path.basename(second.save_state()),
             os.path.basename(first.save_state())]
    assert names == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]  # never the same number twice
    first.end_training()
    second.end_training()
    folder = tmp_path / "project"
    proc = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(60)", "pass"), str(folder)],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          timeout=60)
    assert proc.stdout.strip() == "held", proc.stderr
