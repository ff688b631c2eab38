"""Crash a 2-process training run, resume it, and check it ends exactly where an uninterrupted run ends.

    python examples/crash_and_resume.py                   # the default backend (torch)
    python examples/crash_and_resume.py --backend jax

Runs examples/train.py three times under `unified launch -n 2`: straight to 60 steps; with a
checkpoint every 10 steps and a SIGKILL of process 1 at step 37; then --resume to 60 from the
newest checkpoint (step 30). Exits 0 only when the crash happened and both runs' final
parameters have the same sha256.
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


def train(title, project_dir, *extra):
    """Launch train.py on 2 processes, echo its output; return (exit code, output)."""
    command = [sys.executable, "-m", "unified", "launch", "-n", "2", *(["--backend", args.backend] if args.backend else []),
               TRAIN, "--project-dir", project_dir, "--max-steps", str(args.max_steps), *extra]
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
code, _ = train("1/3 uninterrupted run", straight)
if code != 0:
    problems.append(f"the uninterrupted run failed (exit code {code})")
code, log = train("2/3 run that crashes", crashed, "--save-every", str(args.save_every),
                  "--crash-at-step", str(args.crash_at_step))
if code == 0 or f"SIGKILL at step {args.crash_at_step}" not in log:
    problems.append(f"the run meant to crash did not crash at step {args.crash_at_step} (exit code {code})")
if read_hash(crashed) is not None:
    problems.append("the crashed run wrote final parameters: it did not really stop")
code, log = train("3/3 resumed run", crashed, "--save-every", str(args.save_every), "--resume")
if code != 0 or "resumed from" not in log:
    problems.append(f"the resumed run failed or did not resume (exit code {code})")

expected, got = read_hash(straight), read_hash(crashed)
print("\n=== summary")
print(f"uninterrupted: {expected}\nresumed:       {got}")
if expected is None or expected != got:
    problems.append("the resumed run's parameters differ from the uninterrupted run's")
if problems:
    print("FAILED:\n- " + "\n- ".join(problems))
    sys.exit(1)
print(f"resumed run reached exactly the parameters of the uninterrupted run: {got}")
