"""The training job of benchmarks/goodput.py, written twice over one loop: with unified
(``unified launch --max-restarts``) or with Accelerate (``torchrun --max-restarts``); both resume
from their newest checkpoint by themselves.

    python -m unified launch -n 2 --max-restarts 50 benchmarks/goodput_job.py unified PROJECT STAMPS STEPS
    torchrun --nproc-per-node 2 --max-restarts 50 benchmarks/goodput_job.py accelerate PROJECT STAMPS STEPS

Every process appends JSON lines to STAMPS (its pid, the attempt, and the wall time of: the
script's start, the end of set-up, the end of the load, every step), which the benchmark reads.
A step is a small torch update plus a fixed 30 ms of "compute" (a sleep, so that two processes
on two CPUs keep a steady step time); a checkpoint every 10 steps.
"""
import json
import os
import sys
import time

START = time.time()
KIND, PROJECT, STAMPS, STEPS = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
COMPUTE, SAVE_EVERY, TIMEOUT = 0.03, 10, 60

import torch  # noqa: E402


def stamp(event: str, t: float = 0.0, **extra) -> None:
    line = json.dumps({"event": event, "t": t or time.time(), "pid": os.getpid(), "kind": KIND, **extra})
    with open(STAMPS, "a") as f:
        f.write(line + "\n")


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = Counter()
    if KIND == "unified":
        from unified import Accelerator, ProjectConfiguration

        acc = Accelerator(project_config=ProjectConfiguration(PROJECT, automatic_checkpoint_naming=True, total_limit=2),
                          timeout=TIMEOUT)
        attempt = acc.restart_count
    else:
        from datetime import timedelta

        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

        # the same bound as ours: a restarted torchrun group was seen to wait in gloo's
        # init_process_group for its default 30 minutes
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(PROJECT, automatic_checkpoint_naming=True,
                                                                        total_limit=2),
                          kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=TIMEOUT))])
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, optimizer = acc.prepare(model, optimizer)
    acc.register_for_checkpointing(counter)
    stamp("ready", attempt=attempt, rank=acc.process_index)
    if KIND == "unified":
        acc.load_state(if_exists=True)
    else:  # Accelerate: resume from the newest checkpoint when there is one (its own naming)
        folder = os.path.join(PROJECT, "checkpoints")
        if os.path.isdir(folder) and os.listdir(folder):
            newest = max(os.listdir(folder), key=lambda name: int(name.rsplit("_", 1)[-1]))
            acc.load_state(os.path.join(folder, newest))
            acc.project_configuration.iteration = int(newest.rsplit("_", 1)[-1]) + 1
    stamp("loaded", attempt=attempt, rank=acc.process_index, step=counter.step)
    while counter.step < STEPS:
        x, y = batch(counter.step, acc.process_index)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        acc.backward(loss)
        optimizer.step()
        time.sleep(COMPUTE)
        counter.step += 1
        stamp("step", attempt=attempt, rank=acc.process_index, step=counter.step)
        if counter.step % SAVE_EVERY == 0:
            acc.save_state()
    acc.wait_for_everyone()
    stamp("done", attempt=attempt, rank=acc.process_index)
    acc.end_training()


if __name__ == "__main__":
    stamp("start", t=START)  # before `import torch`
    main()
