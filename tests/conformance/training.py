"""A tiny training setup written for each framework, used by the checkpoint scenarios.

Each step draws from Python's `random`, NumPy's global generator and the framework's RNG,
so a resumed run matches the uninterrupted one only if every generator was restored.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np


class Counter:
    """A registered object with array and plain state."""

    def __init__(self) -> None:
        self.steps = 0
        self.history = np.zeros(4, dtype=np.float64)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "history": self.history.copy(), "note": ("ok", 1)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self.history = np.array(state["history"])


def _host_noise() -> float:
    return random.random() + float(np.random.rand())


class TorchTraining:
    def __init__(self, acc, scheduler: bool = True) -> None:
        import torch

        self.torch, self.acc = torch, acc
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.counter = Counter()
        acc.register_for_checkpointing(self.scheduler, self.counter)

    def step(self) -> None:
        torch = self.torch
        x = torch.randn(4, 6) * _host_noise()
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad()
        self.acc.backward(loss)
        self.optimizer.step()
        self.scheduler.step()
        self.counter.steps += 1
        self.counter.history[self.counter.steps % 4] = self.counter.steps * 0.5  # same on every process

    def draws(self) -> list:
        return [random.random(), float(np.random.rand()), float(self.torch.rand(1))]

    def edit_in_place(self, delta: float, tracked: bool = True) -> None:
        """Weight surgery: ``tracked`` in-place ops under no_grad (they bump the tensors'
        version counters), else through ``.data`` (which does not)."""
        with self.torch.no_grad():
            for p in self.acc.unwrap_model(self.model).parameters():
                (p if tracked else p.data).add_(delta)

    def change_first_layer(self, change: str) -> None:
        """Make this run's model differ from the saving run's: a float64 bias or a wider weight."""
        torch, layer = self.torch, self.acc.unwrap_model(self.model)[0]
        if change == "dtype":
            layer.bias = torch.nn.Parameter(layer.bias.detach().to(torch.float64))
        else:
            layer.weight = torch.nn.Parameter(torch.zeros(8, 7))

    def param_hash(self) -> str:
        digest = hashlib.sha256()
        for tensor in self.acc.unwrap_model(self.model).state_dict().values():
            digest.update(tensor.detach().cpu().numpy().tobytes())
        digest.update(repr(self.counter.history.tolist()).encode())
        return digest.hexdigest()


class JaxTraining:
    def __init__(self, acc, scheduler: bool = True) -> None:
        import jax
        import optax
        from flax import nnx

        self.jax, self.nnx, self.acc = jax, nnx, acc

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.a = nnx.Linear(6, 8, rngs=rngs)
                self.drop = nnx.Dropout(0.2, rngs=rngs)
                self.b = nnx.Linear(8, 1, rngs=rngs)

            def __call__(self, x):
                return self.b(self.drop(self.a(x)))

        model = Net(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.adamw(optax.exponential_decay(0.05, 2, 0.9, staircase=True)), wrt=nnx.Param)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.counter = Counter()
        acc.register_for_checkpointing(self.counter)

        @nnx.jit
        def train_step(model, optimizer, x):
            def loss_fn(model):
                return (model(x) ** 2).mean()

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        self.train_step = train_step

    def step(self) -> None:
        from jax.sharding import NamedSharding, PartitionSpec

        local = np.asarray(self.jax.random.normal(self.acc.next_key(), (4, 6))) * _host_noise()
        sharding = NamedSharding(self.acc.mesh, PartitionSpec("data"))
        x = self.jax.make_array_from_process_local_data(sharding, local.astype(np.float32))  # the global batch
        loss = self.train_step(self.model, self.optimizer, x)
        self.counter.steps += 1
        self.counter.history[self.counter.steps % 4] = self.counter.steps * 0.5  # same on every process

    def draws(self) -> list:
        key = self.acc.next_key()
        return [random.random(), float(np.random.rand()), float(self.jax.random.uniform(key))]

    def edit_in_place(self, delta: float, tracked: bool = True) -> None:
        """The same surgery in JAX: arrays are immutable, so each parameter is replaced."""
        for _, param in self.nnx.iter_graph(self.model):
            if isinstance(param, self.nnx.Param):
                param.value = param.value + delta

    def change_first_layer(self, change: str) -> None:
        """Make this run's model differ from the saving run's: a bfloat16 bias or a wider kernel."""
        import jax.numpy as jnp

        layer = self.model.a
        if change == "dtype":
            layer.bias.value = layer.bias.value.astype(jnp.bfloat16)
        else:
            layer.kernel.value = jnp.zeros((7, 8), jnp.float32)

    def param_hash(self) -> str:
        digest = hashlib.sha256()
        state = self.nnx.state(self.model).to_pure_dict()
        for leaf in self.jax.tree_util.tree_leaves(state):
            if self.jax.dtypes.issubdtype(leaf.dtype, self.jax.dtypes.prng_key):
                leaf = self.jax.random.key_data(leaf)
            digest.update(np.asarray(leaf.addressable_shards[0].data).tobytes())
        digest.update(repr(self.counter.history.tolist()).encode())
        return digest.hexdigest()


def make(acc):
    from profiles import make_training

    return make_training(acc)
