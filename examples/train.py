"""Train a small MLP regression with `unified`: one script, PyTorch or JAX, resumable bit-exactly.

    unified launch -n 2 --backend torch examples/train.py --max-steps 60 --save-every 10
    unified launch -n 2 --backend jax   examples/train.py --max-steps 60 --resume
    UNIFIED_BACKEND=jax python examples/train.py --max-steps 20 --project-dir /tmp/x   # one process
    unified launch -n 2 examples/train.py --max-steps 60 --log-with tensorboard --log-with mlflow
    tensorboard --logdir runs/train/train          # or: --log-with all (every installed tracker)

Batch choice depends only on the global step (an epoch shuffle from the seed, then the step's
slice), so a run resumed from a checkpoint sees exactly the batches the uninterrupted run saw.
"""
import argparse
import hashlib
import os
import signal

import numpy as np
from safetensors.numpy import load_file

from unified import Accelerator, ProjectConfiguration, tqdm

FEATURES, HIDDEN, ROWS = 8, 64, 2048

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--project-dir", default="runs/train")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--save-every", type=int, default=0, help="save_state() every N steps (0: never)")
parser.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint if there is one, else start fresh")
parser.add_argument("--crash-at-step", type=int, default=None,
                    help="SIGKILL one process at this step, in the launcher's first attempt only")
parser.add_argument("--target-loss", type=float, default=0.0, help="stop early below this loss (0: off)")
parser.add_argument("--log-with", action="append", default=None, metavar="TRACKER",
                    help="tensorboard, mlflow, wandb or all (repeatable); files under project_dir "
                         "(pip install 'unified[tracking]')")
args = parser.parse_args()

accelerator = Accelerator(seed=args.seed, log_with=args.log_with, project_config=ProjectConfiguration(
    args.project_dir, automatic_checkpoint_naming=True, total_limit=3))
accelerator.init_trackers("train", config=vars(args))  # main process only; nothing without --log-with
rank, world = accelerator.process_index, accelerator.num_processes
if args.batch_size % world:
    raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {world} processes")
accelerator.print(f"backend={accelerator.backend} processes={world} project_dir={args.project_dir}")

# Data: the main process generates and caches the dataset; the others then read the cache.
data_file = os.path.join(args.project_dir, "data.npz")
with accelerator.main_process_first():
    if not os.path.exists(data_file):
        rng = np.random.default_rng(args.seed)
        x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
        w = rng.standard_normal((FEATURES, 4)).astype(np.float32)
        y = np.tanh(x @ w).sum(axis=1, keepdims=True) + 0.05 * rng.standard_normal((ROWS, 1))
        os.makedirs(args.project_dir, exist_ok=True)
        np.savez(data_file + ".tmp.npz", x=x, y=y.astype(np.float32))
        os.replace(data_file + ".tmp.npz", data_file)  # never a half-written cache
    data = np.load(data_file)
    data_x, data_y = data["x"], data["y"]


class StepCounter:
    """The global step, saved and restored with every checkpoint."""
    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


counter = StepCounter()


def local_rows(step):
    """This process's rows of the global batch for ``step``: a function of the step only."""
    epoch, index = divmod(step, ROWS // args.batch_size)
    order = np.random.default_rng(args.seed + epoch).permutation(ROWS)
    rows = order[index * args.batch_size:(index + 1) * args.batch_size]
    per = args.batch_size // world
    return rows[rank * per:(rank + 1) * per]


def torch_setup():
    """The torch model, optimizer and scheduler, prepared; returns (model, train_step)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=25, gamma=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)  # DDP averages gradients
    accelerator.register_for_checkpointing(scheduler, counter)

    def train_step(rows):
        x, y = (torch.from_numpy(a[rows]).to(accelerator.device) for a in (data_x, data_y))
        loss = torch.nn.functional.mse_loss(model(x), y)  # this process's rows
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        return loss.item()

    return model, train_step


def jax_setup():
    """The Flax NNX model and optax optimizer, prepared; returns (model, train_step)."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    rows_sharding = NamedSharding(accelerator.mesh, PartitionSpec("data"))

    def _global_batch(local):
        """The global batch array from this process's rows (the JAX rule after `prepare`)."""
        return jax.make_array_from_process_local_data(rows_sharding, local)

    rngs = nnx.Rngs(args.seed)
    model = nnx.Sequential(nnx.Linear(FEATURES, HIDDEN, rngs=rngs), jax.nn.tanh,
                           nnx.Linear(HIDDEN, HIDDEN, rngs=rngs), jax.nn.tanh, nnx.Linear(HIDDEN, 1, rngs=rngs))
    schedule = optax.exponential_decay(args.lr, transition_steps=25, decay_rate=0.5, staircase=True)
    optimizer = nnx.Optimizer(model, optax.adamw(schedule), wrt=nnx.Param)
    model, optimizer = accelerator.prepare(model, optimizer)  # replicated on the "data" mesh
    accelerator.register_for_checkpointing(counter)

    @nnx.jit
    def jit_step(model, optimizer, x, y):
        def loss_fn(m):
            err = jax.lax.with_sharding_constraint((m(x) - y) ** 2, rows_sharding)
            return err.mean(), err  # the global mean: gradients cover every process's rows
        (_, err), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return err

    def train_step(rows):
        err = jit_step(model, optimizer, _global_batch(data_x[rows]), _global_batch(data_y[rows]))
        return float(np.mean(np.concatenate([np.asarray(s.data) for s in err.addressable_shards])))

    return model, train_step


# One framework-specific setup per backend, chosen once; everything below is shared.
model, train_step = {"torch": torch_setup, "jax": jax_setup}[accelerator.backend]()

if args.resume:
    path = accelerator.load_state(if_exists=True)  # the newest checkpoint under project_dir/checkpoints, if any
    if path is not None:
        accelerator.print(f"resumed from {path} at step {counter.step} (attempt {accelerator.restart_count})")

crash_rank = 1 if world > 1 else 0
loss = float("nan")
bar = tqdm(total=args.max_steps, initial=counter.step)  # main process only; sparse lines in a log
while counter.step < args.max_steps:
    if counter.step == args.crash_at_step and rank == crash_rank and accelerator.restart_count == 0:
        print(f"[process {rank}] simulated crash: SIGKILL at step {counter.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    local = train_step(local_rows(counter.step))
    counter.step += 1
    loss = float(accelerator.reduce(local, "mean"))  # global mean loss, on every process
    accelerator.log({"train/loss": loss}, step=counter.step)  # to the trackers, main process only
    bar.update(1)
    bar.set_postfix(loss=f"{loss:.4f}")
    if args.save_every and counter.step % args.save_every == 0:
        saved = accelerator.save_state()
        if accelerator.is_main_process:
            bar.write(f"step {counter.step}: saved {saved}")
    if args.target_loss > 0 and loss < args.target_loss:
        accelerator.set_trigger()
    if accelerator.check_trigger():  # collective: every process checks every step
        accelerator.print(f"\nstep {counter.step}: loss {loss:.4f} < {args.target_loss}: stopping early")
        break
bar.close()

accelerator.wait_for_everyone()
final_dir = os.path.join(args.project_dir, "final")
weights = accelerator.save_model(model, final_dir)  # writes on the main process only
if accelerator.is_main_process:
    params = load_file(weights)
    digest = hashlib.sha256()
    for name in sorted(params):  # a fixed order: parameter names, then their bytes
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(params[name]).tobytes())
    open(os.path.join(final_dir, "params.sha256"), "w").write(digest.hexdigest() + "\n")
    print(f"step {counter.step}: loss {loss:.4f}; saved {weights}; params sha256 {digest.hexdigest()}")
accelerator.end_training()  # also closes the trackers' runs
