"""Train from a streaming Hugging Face `datasets` pipeline with DataLoader workers, resumable exactly.

    unified launch -n 2 --backend torch examples/stream_datasets.py --max-steps 40 --save-every 10
    unified launch -n 2 --max-restarts 1 examples/stream_datasets.py --crash-at-step 25   # healed by the launcher

Each process reads only its own JSON-lines shards (`split_dataset_by_node`, done by `prepare`),
spread over 2 workers; every `save_state` holds every process's position in its shards (torchdata's
StatefulDataLoader state, workers included), so a resumed or restarted job continues with exactly
the examples the uninterrupted run would have read, and ends with the same parameters (the
sha256 printed at the end). Needs `pip install 'unified[torch,data,torchdata]'`.
"""
import argparse
import hashlib
import json
import os
import random
import signal

import datasets
import numpy as np
import torch

from unified import Accelerator, ProjectConfiguration

SHARDS, ROWS_PER_SHARD, FEATURES = 8, 512, 16

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--project-dir", default="runs/stream_datasets")
parser.add_argument("--max-steps", type=int, default=40)
parser.add_argument("--batch-size", type=int, default=16, help="per process")
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL process 1 at this step (first attempt)")
args = parser.parse_args()

accelerator = Accelerator(seed=0, project_config=ProjectConfiguration(
    args.project_dir, automatic_checkpoint_naming=True, total_limit=2))

# The data: JSON-lines shards written once by the main process (a stand-in for files on a bucket).
folder = os.path.join(args.project_dir, "shards")
with accelerator.main_process_first():
    if not os.path.isdir(folder):
        rng = np.random.default_rng(0)
        w = rng.standard_normal(FEATURES)
        os.makedirs(folder + ".tmp", exist_ok=True)
        for s in range(SHARDS):
            with open(os.path.join(folder + ".tmp", f"part-{s:02d}.jsonl"), "w") as f:
                for _ in range(ROWS_PER_SHARD):
                    x = rng.standard_normal(FEATURES)
                    f.write(json.dumps({"x": x.tolist(), "y": float(np.tanh(x @ w))}) + "\n")
        os.replace(folder + ".tmp", folder)
files = sorted(os.path.join(folder, name) for name in os.listdir(folder))
random.Random(0).shuffle(files)  # shuffled files, no shuffle buffer: a buffer is not saved (docs/data-pipelines.md)
stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch")

model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = torch.utils.data.DataLoader(stream, batch_size=args.batch_size, num_workers=args.workers)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)



class Progress:
    """The step count, saved with every checkpoint."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


progress = Progress()
accelerator.register_for_checkpointing(progress)
if accelerator.load_state(if_exists=True) is not None:  # a restarted or resumed job
    accelerator.print(f"resumed at step {progress.step} (attempt {accelerator.restart_count})")
step = progress.step
epoch = 0
while step < args.max_steps:
    for batch in loader:
        if args.crash_at_step == step and accelerator.process_index == 1 and accelerator.restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost process: the launcher restarts the group
        loss = torch.nn.functional.mse_loss(model(batch["x"].float()).squeeze(-1), batch["y"].float())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step = progress.step = step + 1
        if step % args.save_every == 0:
            accelerator.save_state()
        if step >= args.max_steps:
            break
    else:
        epoch += 1
        accelerator.print(f"epoch {epoch} done at step {step}")

digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters()))
accelerator.print(f"step {step}: loss {loss.item():.4f}, parameters sha256 {digest.hexdigest()[:16]}")
