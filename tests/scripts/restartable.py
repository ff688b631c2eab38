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
its machine: tests/test_multihost_netns.py); ``damage:STEP:RANK:KIND:PLACE:SEED`` (on the first
attempt, after the save of STEP, the main process flips one byte of the newest ``checkpoint_N``:
in a random file of KIND, ``model``, ``optimizer``, ``rng`` or ``state`` (the registered
objects), at a random offset of PLACE, ``header`` (the safetensors length and JSON header) or
``data`` (the tensor bytes), both drawn from SEED, and prints ``DAMAGED {json}``; after a
``wait_for_everyone`` process RANK SIGKILLs itself as in ``kill:``, so that the next attempt's
``load_state(if_exists=True)`` must fall back to the checkpoint of STEP - 1: tests/faults row 17).
``RESULT`` names the checkpoint the attempt resumed from (``loaded``, or null).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import struct
import sys
import time

from unified import Accelerator, ProjectConfiguration
from unified.testing.kit import kit_of
from unified.tracking import available_trackers

STEPS = 6


def main(project_dir: str, mode: str) -> int:
    # MLflow only: W&B offline start-up costs seconds per attempt in CI; its run id is continued the same way
    # (tracking.md)
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
    damage = mode.split(":")[1:] if mode.startswith("damage:") else None
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
        if damage and acc.restart_count == 0 and int(damage[0]) == step:
            if acc.is_main_process:
                print("DAMAGED " + json.dumps(_damage_newest(project_dir, *damage[2:])), flush=True)
            acc.wait_for_everyone()  # the damage is on disk before anyone dies: the launcher then ends the group
            if int(damage[1]) == acc.process_index:
                _die()
        lose = mode.split(":")[1:] if mode.startswith("lose:") else None
        if lose and acc.restart_count == 0 and lose == [str(step), str(acc.process_index)]:
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
                                  "num_processes": acc.num_processes,
                                  "loaded": os.path.basename(resumed) if resumed else None}), flush=True)
    acc.end_training()
    return 0


def _damage_newest(project_dir: str, kind: str, place: str, seed: str) -> dict:
    """Flip one byte (XOR with a random non-zero value) of a random ``kind`` file of the newest
    ``checkpoint_N``, at a random offset of its ``place``; what was done, for the trial."""
    folder = os.path.join(project_dir, "checkpoints")
    listing = sorted(os.listdir(folder))
    newest = max((n for n in listing if re.fullmatch(r"checkpoint_\d+", n)), key=lambda n: int(n.split("_")[1]))
    prefix = {"model": "model_", "optimizer": "optimizer_", "rng": "rng_", "state": "custom_checkpoint_"}[kind]
    rng = random.Random(seed)
    spans = {}  # file -> (header end, size)
    for name in sorted(os.listdir(os.path.join(folder, newest))):
        if name.startswith(prefix) and name.endswith(".safetensors"):
            with open(os.path.join(folder, newest, name), "rb") as f:
                header_end = 8 + struct.unpack("<Q", f.read(8))[0]
            spans[name] = (header_end, os.path.getsize(os.path.join(folder, newest, name)))
    if place == "data" and not any(size > end for end, size in spans.values()):
        place = "header"  # no tensor bytes in any file of this kind (an empty registered object)
    name = rng.choice(sorted(n for n, (end, size) in spans.items() if place == "header" or size > end))
    end, size = spans[name]
    offset = rng.randrange(0, end) if place == "header" else rng.randrange(end, size)
    path = os.path.join(folder, newest, name)
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ rng.randrange(1, 256)]))
        f.flush()
        os.fsync(f.fileno())
    return {"checkpoint": newest, "file": name, "place": place, "offset": offset, "size": size, "listing": listing}


def _die() -> None:
    print(f"KILLED {time.time()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
