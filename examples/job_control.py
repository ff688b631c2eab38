"""Running and deferring jobs with `unified`: the same script on PyTorch and on JAX.

Shows main_process_first (data preparation, loading weights), wait_for_everyone before
saving, saving on the main process only, and early stopping with set_trigger/check_trigger.

    unified launch -n 2 --backend torch examples/job_control.py --max-steps 200
    unified launch -n 2 --backend jax   examples/job_control.py --max-steps 200
    UNIFIED_BACKEND=jax python examples/job_control.py          # one process
"""
import argparse
import json
import os
import tempfile

import numpy as np
from safetensors.numpy import load_file

from unified import Accelerator

FEATURES, ROWS = 4, 512

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
# The default must be the same path on every process (a mkdtemp() would differ per process).
parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "unified_job_control"))
parser.add_argument("--max-steps", type=int, default=200)
parser.add_argument("--target-loss", type=float, default=0.1)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

accelerator = Accelerator(seed=0)
rank, world = accelerator.process_index, accelerator.num_processes
accelerator.print(f"backend={accelerator.backend} processes={world} output_dir={args.output_dir}")

# 1. Data preparation: the main process creates the file, the others then read the cache.
data_file = os.path.join(args.output_dir, "data.npz")
with accelerator.main_process_first():
    if not os.path.exists(data_file):  # only the main process can get here first
        rng = np.random.default_rng(0)
        x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
        noise = 0.1 + 0.3 * np.linspace(0, 1, ROWS, dtype=np.float32)[:, None]  # later rows: noisier
        y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.7 + noise * rng.standard_normal((ROWS, 1))
        os.makedirs(args.output_dir, exist_ok=True)
        np.savez(data_file, x=x, y=y.astype(np.float32))
        print(f"[process {rank}] created {data_file}")
    else:
        print(f"[process {rank}] read cached {data_file}")
    data = np.load(data_file)
per = ROWS // world  # each process trains on its own contiguous shard
x_local, y_local = data["x"][rank * per:(rank + 1) * per], data["y"][rank * per:(rank + 1) * per]


def torch_setup():
    """torch: a linear model under DDP; returns (model, train_step, load_weights)."""
    import torch

    device = accelerator.device
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)  # DDP averages gradients
    xt, yt = torch.from_numpy(x_local).to(device), torch.from_numpy(y_local).to(device)

    def train_step():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xt), yt)  # this process's shard only
        accelerator.backward(loss)
        optimizer.step()
        return loss.item()

    def load_weights(path):
        fresh = torch.nn.Linear(FEATURES, 1).to(device)
        fresh.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(path).items()})
        with torch.no_grad():
            return torch.nn.functional.mse_loss(fresh(xt), yt).item()

    return model, train_step, load_weights


def jax_setup():
    """Flax NNX: a linear model replicated on the mesh; returns (model, train_step, load_weights)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    model = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(args.lr), wrt=nnx.Param)
    model, optimizer = accelerator.prepare(model, optimizer)  # replicated on a "data" mesh
    rows = NamedSharding(accelerator.mesh, PartitionSpec("data"))  # the mesh the backend replicates on
    xg = jax.make_array_from_process_local_data(rows, x_local)  # global batch, local rows here
    yg = jax.make_array_from_process_local_data(rows, y_local)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(m):
            err = jax.lax.with_sharding_constraint((m(x) - y) ** 2, rows)
            return err.mean(), err
        (_, err), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)  # global mean loss: gradients averaged over processes
        return err

    def train_step():
        err = step(model, optimizer, xg, yg)  # per-example errors, sharded like the rows
        return float(np.mean(np.concatenate([np.asarray(s.data) for s in err.addressable_shards])))

    def load_weights(path):
        fresh = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))
        state = nnx.state(fresh)
        nnx.replace_by_pure_dict(state, {k: jnp.asarray(v) for k, v in load_file(path).items()})
        nnx.update(fresh, state)
        return float(jnp.mean((fresh(jnp.asarray(x_local)) - y_local) ** 2))

# 4. Early stopping: any process may fire the trigger; all processes stop at the same step.

    return model, train_step, load_weights


# One framework-specific setup per backend, chosen once; everything below is shared.
model, train_step, load_weights = {"torch": torch_setup, "jax": jax_setup}[accelerator.backend]()

stop_step, loss = None, float("nan")
for step_index in range(1, args.max_steps + 1):
    loss = train_step()
    if loss < args.target_loss:
        print(f"[process {rank}] step {step_index}: local loss {loss:.4f} < {args.target_loss}: set_trigger()")
        accelerator.set_trigger()
    if accelerator.check_trigger():  # a collective: every process calls it every step
        stop_step = step_index
        break
print(f"[process {rank}] stopped at step {stop_step or args.max_steps} (local loss {loss:.4f})"
      + ("" if stop_step else ": --max-steps reached, no trigger"))
stops = accelerator.gather_object(stop_step or args.max_steps)  # [step of process 0, 1, ...]
assert len(set(stops)) == 1, stops
accelerator.print(f"all processes stopped at step {stops[0]}: {stops}")

# 2. Save: wait for everyone, then write from the main process only.
accelerator.wait_for_everyone()
# save_model writes model.safetensors on the main process only (it is not a collective, so it
# may also be called under `if accelerator.is_main_process:`, as below for another file).
weights = accelerator.save_model(model, args.output_dir)
if accelerator.is_main_process:  # the plain pattern, for anything else written once
    with open(os.path.join(args.output_dir, "train_info.json"), "w") as f:
        json.dump({"backend": accelerator.backend, "stop_step": stop_step, "processes": world}, f)
    print(f"[process {rank}] saved {weights} and train_info.json")
accelerator.wait_for_everyone()

# 3. Load the weights back: the main process first, then the others.
with accelerator.main_process_first():
    reloaded = load_weights(weights)
print(f"[process {rank}] reloaded weights: local loss {reloaded:.4f} (before the last update: {loss:.4f})")
accelerator.end_training()
