"""Train a small regression MLP with Hugging Face Accelerate: mixed precision, gradient
accumulation, clipping, evaluation with gather_for_metrics, TensorBoard logging, checkpoints,
resume, early stop.

    accelerate launch --num_processes 2 accelerate_script.py --project-dir runs/acc
    accelerate launch --num_processes 2 accelerate_script.py --project-dir runs/acc --resume

The main process builds and caches the dataset; the model, optimizer and data loader are
prepared for distributed training, the LR scheduler and a progress counter are registered for
checkpointing. Any process can ask every process to stop early (``--target-loss``): the run
then saves a checkpoint and exits, and ``--resume`` continues from the newest checkpoint.
"""
import argparse
import hashlib
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description="small Accelerate regression")
parser.add_argument("--project-dir", default="runs/accelerate_script")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=16, help="per process")
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--save-every", type=int, default=10, help="save_state() every N steps")
parser.add_argument("--target-loss", type=float, default=0.0, help="stop early below this loss (0: off)")
parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
parser.add_argument("--mixed-precision", default="bf16")
parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--max-grad-norm", type=float, default=1.0)
args = parser.parse_args()

set_seed(args.seed)
config = ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2)
accelerator = Accelerator(project_config=config, mixed_precision=args.mixed_precision,
                          gradient_accumulation_steps=args.grad_accum, log_with="tensorboard")
accelerator.init_trackers("accelerate_script", config={"lr": args.lr, "grad_accum": args.grad_accum})
accelerator.print(f"processes={accelerator.num_processes} device={accelerator.device}")


class Progress:
    """The global step and the number of checkpoints written, saved with every checkpoint."""

    def __init__(self):
        self.step = 0
        self.saves = 0

    def state_dict(self):
        return {"step": self.step, "saves": self.saves}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.saves = int(state["saves"])


def build_dataset(path, rows=640 + 90, features=8):
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, features, generator=generator)
    w = torch.randn(features, 1, generator=generator)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(rows, 1, generator=generator)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"x": x, "y": y}, path + ".tmp")
    os.replace(path + ".tmp", path)  # the other processes never see a half-written file


# The main process builds the dataset once; the others then read its cache.
data_path = os.path.join(args.project_dir, "data", "regression.pt")
with accelerator.main_process_first():
    if not os.path.exists(data_path):
        build_dataset(data_path)
    data = torch.load(data_path, weights_only=True)
dataset = TensorDataset(data["x"][:640], data["y"][:640])
eval_dataset = TensorDataset(data["x"][640:], data["y"][640:])  # 90 rows: uneven over 2 processes

model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
train_dataloader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
eval_dataloader = DataLoader(eval_dataset, batch_size=2 * args.batch_size)

model, optimizer, train_dataloader, eval_dataloader, scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, scheduler)
progress = Progress()
accelerator.register_for_checkpointing(progress)
steps_per_epoch = len(train_dataloader)

starting_epoch, resume_step = 0, 0
if args.resume:
    accelerator.load_state()  # the newest checkpoint_N under project_dir/checkpoints
    accelerator.project_configuration.iteration = progress.saves  # the next save: checkpoint_{saves}
    starting_epoch, resume_step = divmod(progress.step, steps_per_epoch)
    accelerator.print(f"resumed at step {progress.step} (epoch {starting_epoch}, batch {resume_step})")


def save_checkpoint():
    progress.saves += 1
    accelerator.save_state()


stopped = False
for epoch in range(starting_epoch, args.epochs):
    model.train()
    if epoch == starting_epoch and resume_step:
        active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
    else:
        active_dataloader = train_dataloader
    epoch_loss, batches = 0.0, 0
    for x, y in active_dataloader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        progress.step += 1
        epoch_loss, batches = epoch_loss + loss.item(), batches + 1

        if args.target_loss and loss.item() < args.target_loss:
            accelerator.set_trigger()  # this process alone decides ...
        # ... and every process stops at the same step, after an optimizer step (sync_gradients is
        # the same on every process, so the collective check_trigger stays aligned)
        if accelerator.sync_gradients and accelerator.check_trigger():
            save_checkpoint()
            accelerator.print(f"early stop at step {progress.step}: checkpoint saved")
            stopped = True
            break
        if progress.step % args.save_every == 0:
            save_checkpoint()
    mean = accelerator.reduce(torch.tensor([epoch_loss / max(batches, 1)], device=accelerator.device), "mean")
    accelerator.print(f"epoch {epoch}: {batches} batches, mean loss {mean.item():.4f}, "
                      f"lr {scheduler.get_last_lr()[0]:.5f}")
    model.eval()
    errors = []
    with torch.no_grad():
        for x, y in eval_dataloader:
            errors.append(accelerator.gather_for_metrics((model(x) - y).pow(2)))
    errors = torch.cat(errors)
    accelerator.print(f"eval: {len(errors)} samples, mse {errors.mean().item():.4f}")
    accelerator.log({"train_loss": mean.item(), "eval_mse": errors.mean().item()}, step=epoch)
    if stopped:
        break

accelerator.wait_for_everyone()
if not stopped:
    accelerator.save_model(model, os.path.join(args.project_dir, "final_model"))
    weights = accelerator.unwrap_model(model).state_dict()
    digest = hashlib.sha256(b"".join(weights[k].detach().cpu().numpy().tobytes() for k in sorted(weights)))
    accelerator.print(f"finished at step {progress.step}; weights sha256 {digest.hexdigest()[:16]}")
    accelerator.print("model saved: "
                      f"{os.path.exists(os.path.join(args.project_dir, 'final_model', 'model.safetensors'))}")
accelerator.end_training()
