"""A training job that resumes by itself: ``load_state(if_exists=True)``, then a step and a save
per iteration; prints ``RESULT {json}`` at the end (tests/test_restarts.py).

    python -m unified launch -n 2 --max-restarts N tests/scripts/restartable.py PROJECT_DIR MODE

MODE: ``none``; ``until:N`` (as ``none``, stopping after step N - 1: a job resumed by hand on
another process count); ``kill-once`` (process 1 SIGKILLs itself after the save of step 3, on the first
attempt only; the MLflow tracker logs every step and every attempt prints the
runs it logs into: ``TRACKERS {json}``); ``crash-at-start`` (every attempt exits with 3 before its first step);
``preempt`` (process 0 gets SIGUSR1 after step 2, as from a scheduler: every process saves and
exits as preempted, 75, through ``exit_if_preempted``); ``kill:STEP:RANK:WHEN`` (process RANK
SIGKILLs itself at STEP on the first attempt, WHEN ``before-step`` or ``after-save``, printing
``KILLED {time}`` first; every attempt after the first prints ``RESUMED {time}`` before its first
step: tests/faults row 14); ``lose:STEP:RANK`` (on the first attempt, process RANK
writes ``PROJECT_DIR/lost-ready`` after the save of STEP and waits there to be taken away with
its machine: tests/test_multihost_netns.py).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from unified import Accelerator, ProjectConfiguration
from unified.tracking import available_trackers
from unified.testing.kit import kit_of

STEPS = 6


def main(project_dir: str, mode: str) -> int:
    # MLflow only: W&B offline start-up costs seconds per attempt in CI; its run id is continued the same way (tracking.md)
    trackers = [t for t in ("mlflow",) if t in available_trackers()] if mode == "kill-once" else None
    acc = Accelerator(project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True, total_limit=2),
                      timeout=20, seed=7, handle_preemption=mode == "preempt", log_with=trackers)
    training = kit_of(acc.backend).training(acc)
    acc.init_trackers("restartable")  # before load_state, as scripts do: the runs of the checkpoint are continued
    if trackers and acc.is_main_process:
        print("TRACKERS " + json.dumps({t: acc.get_tracker(t).identity() for t in trackers}), flush=True)
    resumed = acc.load_state(if_exists=True)
    if mode == "crash-at-start":
        raise SystemExit(3)
    first = training.counter.steps
    kill = mode.split(":")[1:] if mode.startswith("kill:") else None
    if acc.restart_count and acc.is_main_process:
        print(f"RESUMED {time.time()}", flush=True)
    last = int(mode.split(":")[1]) if mode.startswith("until:") else STEPS
    for step in range(first, last):
        if kill and acc.restart_count == 0 and int(kill[0]) == step and int(kill[1]) == acc.process_index:
            if kill[2] == "before-step":
                _die()
        training.step()
        acc.log({"step_done": step}, step=step)
        acc.save_state()
        if mode == "kill-once" and acc.restart_count == 0 and step == 3 and acc.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if kill and acc.restart_count == 0 and int(kill[0]) == step and int(kill[1]) == acc.process_index:
            _die()
        if mode.startswith("lose:") and acc.restart_count == 0 and mode.split(":")[1:] == [str(step), str(acc.process_index)]:
            with open(os.path.join(project_dir, "lost-ready"), "w") as marker:
                marker.write(str(os.getpid()))
            time.sleep(600)
        if mode == "preempt" and step == 2 and acc.process_index == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        if acc.check_trigger():
            acc.save_state()
            break
    acc.exit_if_preempted()
    print("RESULT " + json.dumps({"hash": training.param_hash(), "restart_count": acc.restart_count,
                                  "resumed": resumed is not None, "first_step": first,
                                  "num_processes": acc.num_processes}), flush=True)
    acc.end_training()
    return 0


def _die() -> None:
    print(f"KILLED {time.time()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
