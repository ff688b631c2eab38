"""Crash a 2-process training run; the launcher heals it, and it ends where an uninterrupted run ends.

    python examples/crash_and_resume.py                   # the default backend (torch)
    python examples/crash_and_resume.py --backend jax

Runs examples/train.py twice under `unified launch -n 2`: straight to 60 steps; then with a
checkpoint every 10 steps, a SIGKILL of process 1 at step 37 and `--max-restarts 1`, so the
launcher stops the group, starts it again, and the script (`--resume`: load_state(if_exists=True))
continues from the newest checkpoint (step 30) to 60, with no second command. Exits 0 only when
the crash happened, the launcher restarted the group once, and both runs' final parameters have
the same sha256.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--backend", choices=["torch", "jax"], default=None, help="default: unified's default")
parser.add_argument("--workdir", default="runs", help="outputs go to WORKDIR/straight and WORKDIR/crashed")
parser.add_argument("--max-steps", type=int, default=60)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--crash-at-step", type=int, default=37)
args = parser.parse_args()
straight, crashed = (os.path.join(args.workdir, name) for name in ("straight", "crashed"))


def train(title, project_dir, *extra, launcher=()):
    """Launch train.py on 2 processes, echo its output; return (exit code, output)."""
    command = [sys.executable, "-m", "unified", "launch", "-n", "2",
               *(["--backend", args.backend] if args.backend else []),
               *launcher, TRAIN, "--project-dir", project_dir, "--max-steps", str(args.max_steps), *extra]
    print(f"\n=== {title}\n$ {' '.join(command)}", flush=True)
    start, lines = time.monotonic(), []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    print(f"=== {title}: exit code {proc.returncode} after {time.monotonic() - start:.1f}s", flush=True)
    return proc.returncode, "".join(lines)


def read_hash(project_dir):
    path = os.path.join(project_dir, "final", "params.sha256")
    return open(path).read().strip() if os.path.exists(path) else None


for old in (straight, crashed):
    shutil.rmtree(old, ignore_errors=True)

problems = []
code, _ = train("1/2 uninterrupted run", straight)
if code != 0:
    problems.append(f"the uninterrupted run failed (exit code {code})")
code, log = train("2/2 run that crashes and is restarted by the launcher", crashed,
                  "--save-every", str(args.save_every),
                  "--crash-at-step", str(args.crash_at_step), "--resume", launcher=("--max-restarts", "1"))
if f"SIGKILL at step {args.crash_at_step}" not in log:
    problems.append(f"the run meant to crash did not crash at step {args.crash_at_step}")
if "unified launch: restart 1 of 1" not in log or "resumed from" not in log:
    problems.append("the launcher did not restart the group, or the restarted group did not resume")
if code != 0:
    problems.append(f"the healed run failed (exit code {code})")

expected, got = read_hash(straight), read_hash(crashed)
print("\n=== summary")
print(f"uninterrupted: {expected}\nhealed:        {got}")
if expected is None or expected != got:
    problems.append("the resumed run's parameters differ from the uninterrupted run's")
if problems:
    print("FAILED:\n- " + "\n- ".join(problems))
    sys.exit(1)
print(f"the run healed by the launcher reached exactly the parameters of the uninterrupted run: {got}")
