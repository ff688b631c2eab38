"""An Accelerate script runs on unified after changing only its import lines.

``tests/migration/accelerate_script.py`` is written against Hugging Face Accelerate's API. The
test rewrites its ``from accelerate... import`` lines to ``from unified... import``, checks that
nothing else changed, and runs the result on 2 torch processes with ``unified launch``: an early
stop through the trigger, then a resume from the newest checkpoint. Accelerate itself is never
imported (a stub on ``PYTHONPATH`` makes any ``import accelerate`` fail).
"""
import difflib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "migration" / "accelerate_script.py"
TIMEOUT = 180
IMPORT_LINE = re.compile(r"^(\s*from\s+)accelerate((?:\.\w+)*\s+import\s)")


def to_unified(source: str) -> str:
    """Replace ``accelerate`` by ``unified`` in ``from accelerate[.x] import ...`` lines only."""
    return "".join(IMPORT_LINE.sub(r"\1unified\2", line, count=1)
                   for line in source.splitlines(keepends=True))


def changed_lines(before: str, after: str):
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def launch(script: Path, cwd: Path, *args: str) -> str:
    stub = cwd / "no_accelerate"
    (stub / "accelerate").mkdir(parents=True, exist_ok=True)
    (stub / "accelerate" / "__init__.py").write_text(
        "raise ImportError('the migrated script must not need accelerate')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub), str(REPO), env.get("PYTHONPATH")]))
    for name in ("UNIFIED_BACKEND", "UNIFIED_LAUNCHER_BACKEND"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "unified", "launch", "-n", "2", "--backend", "torch", str(script), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{output[-6000:]}"
    return output


def main_lines(output: str) -> list:
    """Lines printed by process 0 (``accelerator.print``), without the launcher's prefix."""
    return [line[4:] for line in output.splitlines() if line.startswith("[0] ")]


def test_only_import_lines_change():
    before = SCRIPT.read_text()
    assert "from accelerate import Accelerator" in before  # really written against Accelerate
    after = to_unified(before)
    assert changed_lines(before, after) == [
        "-from accelerate import Accelerator",
        "-from accelerate.utils import ProjectConfiguration, set_seed",
        "+from unified import Accelerator",
        "+from unified.utils import ProjectConfiguration, set_seed",
    ]
    assert not re.search(r"^\s*(from|import)\s+accelerate\b", after, re.M)


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    work = tmp_path_factory.mktemp("migration")
    script = work / "train.py"
    script.write_text(to_unified(SCRIPT.read_text()))
    return work, script


@pytest.fixture(scope="module")
def stop_and_resume(migrated):
    work, script = migrated
    project = work / "run"
    first = main_lines(launch(script, work, "--project-dir", str(project), "--target-loss", "0.1"))
    second = main_lines(launch(script, work, "--project-dir", str(project), "--resume"))
    return project, first, second


@pytest.mark.multiprocess
@needs_torch
def test_migrated_script_stops_early_and_resumes(stop_and_resume):
    project, first, second = stop_and_resume
    assert re.fullmatch(r"processes=2 device=\S+", first[0]), first
    stops = [re.fullmatch(r"early stop at step (\d+): checkpoint saved", line) for line in first]
    stops = [m for m in stops if m]
    assert len(stops) == 1, first
    step = int(stops[0].group(1))
    assert not any(line.startswith("finished") for line in first), first

    steps_per_epoch = 20  # 640 rows / (16 per process x 2 processes)
    epoch, batch = divmod(step, steps_per_epoch)
    assert f"resumed at step {step} (epoch {epoch}, batch {batch})" in second, second
    epochs = [re.match(r"epoch (\d+): (\d+) batches, mean loss [\d.]+, lr [\d.]+$", line) for line in second]
    assert [(int(m.group(1)), int(m.group(2))) for m in epochs if m][-1] == (2, steps_per_epoch), second
    evaluations = [line for line in first + second if line.startswith("eval: ")]
    assert evaluations and all(re.fullmatch(r"eval: 90 samples, mse [\d.]+", line) for line in evaluations), evaluations
    if batch:  # the interrupted epoch continues with the batches it had left
        assert f"epoch {epoch}: {steps_per_epoch - batch} batches" in "\n".join(second), second
    assert any(re.fullmatch(r"finished at step 60; weights sha256 [0-9a-f]{16}", line) for line in second), second
    assert "model saved: True" in second, second
    assert (project / "final_model" / "model.safetensors").is_file()
    runs = list((project / "accelerate_script").glob("events.out.tfevents.*"))  # log_with="tensorboard"
    assert len(runs) == 2, runs  # one event file per launch, written by the main process only
    checkpoints = sorted(p.name for p in (project / "checkpoints").iterdir())
    assert len(checkpoints) == 2 and all(re.fullmatch(r"checkpoint_\d+", c) for c in checkpoints), checkpoints


@pytest.mark.multiprocess
@needs_torch
def test_resumed_run_matches_uninterrupted_run(migrated, stop_and_resume):
    work, script = migrated
    _, _, resumed = stop_and_resume
    straight = main_lines(launch(script, work, "--project-dir", str(work / "straight")))
    digest = [line for line in straight if line.startswith("finished at step 60")]
    assert digest and digest[0] in resumed, (straight, resumed)
