"""N-D parallelism with `unified.ParallelismConfig` (Accelerate's): HSDP, tensor parallelism or
both, the same script on PyTorch and on JAX.

    unified launch -n 4 --backend torch examples/nd_parallel.py --dp-shard 2 --tp 2
    unified launch -n 4 --backend jax   examples/nd_parallel.py --dp-replicate 2 --dp-shard 2
    unified launch -n 4 --backend torch examples/nd_parallel.py --tp 4 --resume

The model carries its tensor-parallel plan: on torch a ``tp_plan`` dict of submodule names to
``"colwise"`` / ``"rowwise"`` (as transformers' models carry ``_tp_plan``), on JAX
``nnx.with_partitioning`` annotations naming the ``tp`` axis. Every process of one
tensor-parallel group reads the same batches; checkpoints are sharded and load on another mesh.
"""
import argparse
import os

import numpy as np

import unified
from unified import Accelerator, ParallelismConfig, ProjectConfiguration

FEATURES, HIDDEN, ROWS = 8, 32, 512

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--dp-replicate", type=int, default=1)
parser.add_argument("--dp-shard", type=int, default=1)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--project-dir", default="runs/nd_parallel")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint, if any")
args = parser.parse_args()

config = ParallelismConfig(dp_replicate_size=args.dp_replicate, dp_shard_size=args.dp_shard, tp_size=args.tp)
accelerator = Accelerator(seed=0, parallelism_config=config, project_config=ProjectConfiguration(
    args.project_dir, automatic_checkpoint_naming=True, total_limit=2))
accelerator.print(f"backend={accelerator.backend} {config}")
print(f"process {accelerator.process_index}: dp_replicate rank {accelerator.data_parallel_rank}, dp_shard rank "
      f"{accelerator.data_parallel_shard_rank}, tp rank {accelerator.tensor_parallel_rank}", flush=True)


class Regression:
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
        self.y = np.tanh(self.x @ rng.normal(size=(FEATURES, 1))).astype(np.float32)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def torch_side():
    import torch

    class MLP(torch.nn.Module):
        tp_plan = {"up": "colwise", "down": "rowwise"}  # parallelize_module over the "tp" dimension

        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Linear(HIDDEN, 1)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(batch):
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    return step


def jax_side():
    import jax
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs) -> None:
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(FEATURES, HIDDEN, rngs=rngs, kernel_init=nnx.with_partitioning(init, (None, "tp")))
            self.down = nnx.Linear(HIDDEN, 1, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("tp", None)))

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    with jax.set_mesh(accelerator.mesh):  # annotated variables are placed on the named mesh
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    model, optimizer = accelerator.prepare(model, optimizer)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    return lambda batch: float(train_step(model, optimizer, batch["x"], batch["y"]))


step = torch_side() if accelerator.backend == "torch" else jax_side()
loader = accelerator.prepare(unified.DataLoader(Regression(), batch_size=args.batch_size, shuffle=True, seed=0))
done = 0
if args.resume and accelerator.load_state(if_exists=True) is not None:
    done = accelerator.save_iteration * 10
    accelerator.print(f"resumed at step {done}")
while done < args.steps:
    for batch in loader:
        loss = step(batch)
        done += 1
        if done % 10 == 0:
            accelerator.save_state()
            accelerator.print(f"step {done}: loss {loss:.4f} (saved)")
        if done == args.steps:
            break
accelerator.end_training()
if accelerator.is_main_process:
    print(f"done after {done} steps; checkpoints in {os.path.join(args.project_dir, 'checkpoints')}")
