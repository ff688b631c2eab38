"""A training script run by the preemption tests through `unified launch`, on any backend.

Usage: ``python -m unified.testing.preemption_run SHARED TAG --steps N [--signal-at K --expect-signal WHO]``.

It trains the conformance suite's tiny setup (training.py) with
``Accelerator(handle_preemption=True)`` and automatic checkpoint naming under ``SHARED/project``,
resumes from the newest checkpoint there, and stops as a preempted job does:
``if accelerator.check_trigger(): accelerator.save_state(); break`` then
``accelerator.exit_if_preempted()``.

At step K every process writes ``SHARED/TAG-ready-<rank>`` (its pid) and waits for
``SHARED/TAG-go``, which the test writes after it sent the signal; the processes that the signal
reaches (WHO: a process index, or ``all`` when it went to the launcher) then wait until their
handler ran, so that every process must stop at step K exactly. Before exiting, each process writes
``SHARED/TAG-result-<rank>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import unified
from unified.testing.training import make


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as file:
        file.write(text)
    os.replace(path + ".tmp", path)


def _meet_the_signal(acc: unified.Accelerator, shared: str, tag: str, expect: str) -> None:
    _write(os.path.join(shared, f"{tag}-ready-{acc.process_index}"), str(os.getpid()))
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(shared, f"{tag}-go")):
        assert time.monotonic() < deadline, "the test never sent the signal"
        time.sleep(0.01)
    if expect in ("all", str(acc.process_index)):
        flag = acc._signals  # test-only peek: the handler ran in this process
        while flag.count <= acc._signals_seen:
            assert time.monotonic() < deadline, "the signal never arrived"
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shared")
    parser.add_argument("tag")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--signal-at", type=int, default=0)
    parser.add_argument("--expect-signal", default="")
    args = parser.parse_args()
    project = unified.ProjectConfiguration(os.path.join(args.shared, "project"), automatic_checkpoint_naming=True)
    acc = unified.Accelerator(timeout=60, seed=7, project_config=project, handle_preemption=True)
    run = make(acc)
    checkpoints = os.path.join(args.shared, "project", "checkpoints")
    loaded = None
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        loaded = os.path.basename(acc.load_state())
    start = run.counter.steps
    stopped, saved, signalled_at = None, None, None
    for step in range(start + 1, args.steps + 1):
        run.step()
        if step == args.signal_at:
            _meet_the_signal(acc, args.shared, args.tag, args.expect_signal)
            signalled_at = time.time()
        if acc.check_trigger():
            saved = os.path.basename(acc.save_state())
            stopped = step
            break
    result = {"pid": os.getpid(), "loaded": loaded, "start": start, "stopped": stopped, "saved": saved,
              "preempted": acc.preempted, "steps": run.counter.steps, "hash": run.param_hash(),
              "signalled_at": signalled_at, "saved_at": time.time() if saved else None}
    _write(os.path.join(args.shared, f"{args.tag}-result-{acc.process_index}.json"), json.dumps(result))
    acc.exit_if_preempted()
    acc.end_training()


if __name__ == "__main__":
    main()
