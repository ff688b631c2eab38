"""Classify scikit-learn's handwritten digits with an MLP: one script, PyTorch or JAX, resumable.

    unified launch -n 2 --backend torch examples/digits.py --max-steps 30 --save-every 10
    unified launch -n 2 --backend torch examples/digits.py --max-steps 60 --resume
    unified launch -n 2 --backend jax   examples/digits.py --project-dir runs/digits-jax --target-accuracy 0.95
    unified launch -n 2 --mixed-precision bf16 examples/digits.py --grad-accum 2 --max-grad-norm 1.0
    UNIFIED_BACKEND=jax python examples/digits.py --max-steps 20          # one process

Checkpoints go to {project-dir}/checkpoints (the newest 3 are kept); --resume continues from the
newest, data position included. Training stops early once the test accuracy reaches
--target-accuracy. Needs scikit-learn (`pip install -e '.[examples]'`); the digits data ships with it.
"""
import argparse
import os

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from unified import Accelerator, DataLoader, ProjectConfiguration, tqdm

FEATURES, HIDDEN, CLASSES = 64, 128, 10

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--project-dir", default="runs/digits")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--max-steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--save-every", type=int, default=0, help="save_state() every N steps (0: never)")
parser.add_argument("--eval-every", type=int, default=10, help="test accuracy every N steps")
parser.add_argument("--target-accuracy", type=float, default=0.96, help="stop early at this test accuracy")
parser.add_argument("--resume", action="store_true", help="load the newest checkpoint and continue")
parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
parser.add_argument("--max-grad-norm", type=float, default=0.0, help="clip gradients to this norm (0: off)")
args = parser.parse_args()

# mixed_precision comes from `unified launch --mixed-precision` (UNIFIED_MIXED_PRECISION), else "no".
accelerator = Accelerator(seed=args.seed, gradient_accumulation_steps=args.grad_accum,
                          project_config=ProjectConfiguration(
                              args.project_dir, automatic_checkpoint_naming=True, total_limit=3))
world = accelerator.num_processes
if args.batch_size % world:
    raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {world} processes")
accelerator.print(f"backend={accelerator.backend} processes={world} project_dir={args.project_dir}")

# Data: the main process prepares and caches the split; the others then read the cache.
data_file = os.path.join(args.project_dir, "digits.npz")
with accelerator.main_process_first():
    if not os.path.exists(data_file):
        digits = load_digits()
        x_train, x_test, y_train, y_test = train_test_split(
            digits.data.astype(np.float32), digits.target.astype(np.int32), test_size=0.25,
            stratify=digits.target, random_state=args.seed)
        mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-3  # training statistics only
        os.makedirs(args.project_dir, exist_ok=True)
        np.savez(data_file + ".tmp.npz", x_train=(x_train - mean) / std, y_train=y_train,
                 x_test=(x_test - mean) / std, y_test=y_test)
        os.replace(data_file + ".tmp.npz", data_file)  # never a half-written cache
    data = dict(np.load(data_file))


class Rows:
    """A map-style dataset: sample ``i`` is ``(x[i], y[i])`` as NumPy values."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class StepCounter:
    """The global step, saved and restored with every checkpoint."""
    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


counter = StepCounter()
train_loader = DataLoader(Rows(data["x_train"], data["y_train"]), batch_size=args.batch_size // world,
                          shuffle=True, seed=args.seed, drop_last=True)
# The whole test set in one global batch; the uneven end is padded with repeats (sliced off below).
test_loader = DataLoader(Rows(data["x_test"], data["y_test"]), batch_size=-(-len(data["x_test"]) // world))


def torch_setup(train_loader, test_loader):
    """torch: an MLP under DDP, prepared with its optimizer and loaders."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    accelerator.register_for_checkpointing(scheduler, counter)

    def train_step(x, y):  # this process's rows; DDP averages the gradients at each window's end
        loss = torch.nn.functional.cross_entropy(model(x), y.long())  # labels are cached as int32 for JAX
        accelerator.backward(loss)  # divided by --grad-accum (and scaled under fp16)
        if args.max_grad_norm and accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()  # the prepared optimizer steps at the end of each accumulation window only
        if accelerator.sync_gradients:
            scheduler.step()  # registered, not prepared: stepped by us, once per optimizer step
        optimizer.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def correct(x, y):
        return (model(x).argmax(dim=1) == y).float()

    return model, train_loader, test_loader, train_step, correct


def jax_setup(train_loader, test_loader):
    """Flax NNX: an MLP replicated on the mesh, prepared with its optimizer and loaders."""
    import optax
    from flax import nnx

    rngs = nnx.Rngs(args.seed)
    model = nnx.Sequential(nnx.Linear(FEATURES, HIDDEN, rngs=rngs), nnx.relu,
                           nnx.Linear(HIDDEN, HIDDEN, rngs=rngs), nnx.relu, nnx.Linear(HIDDEN, CLASSES, rngs=rngs))
    schedule = optax.exponential_decay(args.lr, transition_steps=50, decay_rate=0.5, staircase=True)
    optimizer = nnx.Optimizer(model, optax.adamw(schedule), wrt=nnx.Param)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    accelerator.register_for_checkpointing(counter)  # the schedule's position is in the optimizer state

    @nnx.jit
    def jit_train_step(model, optimizer, x, y):  # x, y: the global batch, so the loss is the global mean
        def loss_fn(m):  # under bf16 the logits are bfloat16: the loss is computed in float32
            return optax.softmax_cross_entropy_with_integer_labels(m(x).astype(np.float32), y).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        if args.max_grad_norm:
            grads, _ = accelerator.clip_grad_norm_(grads, args.max_grad_norm)
        optimizer.update(model, grads)  # with --grad-accum N: applied on every N-th call
        return loss

    @nnx.jit
    def jit_correct(model, x, y):  # sharded like the rows: each process holds its own
        return (model(x).argmax(axis=1) == y).astype(np.float32)

    def train_step(x, y):
        return jit_train_step(model, optimizer, x, y)

    def correct(x, y):
        return jit_correct(model, x, y)

    return model, train_loader, test_loader, train_step, correct


# One framework-specific setup per backend, chosen once; everything below is shared.
model, train_loader, test_loader, train_step, correct = {"torch": torch_setup, "jax": jax_setup}[accelerator.backend](
    train_loader, test_loader)

def test_accuracy():
    """Accuracy on the whole test set: each process scores its rows, `gather_for_metrics` joins
    them without the samples repeated to fill up the last batch, so each counts once."""
    hits = 0.0
    for x, y in test_loader:
        hits += float(accelerator.gather_for_metrics(correct(x, y)).sum())
    return hits / len(test_loader.dataset)


if args.resume:
    path = accelerator.load_state()  # the newest checkpoint; also restores the loaders' positions
    accelerator.print(f"resumed from {os.path.basename(path)} at step {counter.step} "
                      f"(epoch {train_loader.epoch}, batch {train_loader.position} of {len(train_loader)})")

steps_per_epoch = len(train_loader)
# Accelerate's idiom. load_state already put the loader at this batch; skip_first_batches takes an
# absolute position, so it lands on the same batch instead of skipping again (asserted below).
batches = accelerator.skip_first_batches(train_loader, counter.step % steps_per_epoch) if args.resume else train_loader
bar = tqdm(total=args.max_steps, initial=counter.step)  # main process only; sparse lines in a log
log = accelerator.on_main_process(bar.write)  # print without breaking the bar
accuracy, loss, done = float("nan"), float("nan"), counter.step >= args.max_steps
while not done:
    for x, y in batches:
        with accelerator.accumulate(model):
            loss = train_step(x, y)
        counter.step += 1
        assert train_loader.epoch * steps_per_epoch + train_loader.position == counter.step, "data out of step"
        bar.update(1)
        if args.save_every and counter.step % args.save_every == 0:
            saved = accelerator.save_state()  # a collective: every process saves its part
            log(f"step {counter.step}: saved {saved}")
        if counter.step % args.eval_every == 0 or counter.step == args.max_steps:
            accuracy = test_accuracy()
            loss = float(accelerator.reduce(loss, "mean"))  # torch: each process's loss is its rows'
            log(f"step {counter.step}: loss {loss:.4f}, test accuracy {accuracy:.4f}")
            if accuracy >= args.target_accuracy:
                accelerator.set_trigger()
        bar.set_postfix(loss=f"{float(loss):.3f}", test_acc=f"{accuracy:.3f}")
        if accelerator.check_trigger():  # a collective: every process checks every step
            log(f"step {counter.step}: test accuracy {accuracy:.4f} >= {args.target_accuracy}: stopping early")
            done = True
        done = done or counter.step >= args.max_steps
        if done:
            break
    batches = train_loader  # later epochs start at their first batch
bar.close()

accelerator.wait_for_everyone()
if accelerator.is_main_process:
    weights = accelerator.save_model(model, os.path.join(args.project_dir, "final"))
    print(f"step {counter.step}: saved the final model {weights}")
accelerator.end_training()
