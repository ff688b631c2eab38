"""The JAX backend's testing kit: the tiny training setups the conformance suite
(`unified.testing`) runs on JAX. Imported only by the suite (`BackendSpec.testing_kit`); every
framework import is inside the setups."""
from __future__ import annotations

import hashlib
import os
import random
import re
from typing import Dict

import numpy as np

from unified import Accelerator
from unified.testing import Kit
from unified.testing.loop_scenarios import FEATURES
from unified.testing.training import Counter, host_noise


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
        optimizer = nnx.Optimizer(model, optax.adamw(optax.exponential_decay(0.05, 2, 0.9, staircase=True)),
                                  wrt=nnx.Param)
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

        local = np.asarray(self.jax.random.normal(self.acc.next_key(), (4, 6))) * host_noise()
        sharding = NamedSharding(self.acc.mesh, PartitionSpec("data"))
        x = self.jax.make_array_from_process_local_data(sharding, local.astype(np.float32))  # the global batch
        self.train_step(self.model, self.optimizer, x)
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


class JaxSetup:
    returns_float32 = False  # NNX modules computing in bf16 return bf16

    def __init__(self, acc: Accelerator, lr: float = 0.05) -> None:
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        self.jax, self.jnp, self.nnx, self.acc = jax, jnp, nnx, acc

        class Model(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.first = nnx.Linear(FEATURES, 8, rngs=rngs)
                self.last = nnx.Linear(8, 1, rngs=rngs)

            def __call__(self, x):
                return self.last(jnp.tanh(self.first(x)))

        model = Model(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
        self.model, self.optimizer = acc.prepare(model, optimizer)

        @nnx.jit
        def step(model, optimizer, x, y, loss_scale):
            def loss_fn(m):
                return ((m(x).astype(jnp.float32) - y) ** 2).mean() * loss_scale

            grads = nnx.grad(loss_fn)(model)
            optimizer.update(model, grads)

        self._step = step

    def scheduler_steps(self) -> None:
        return None  # optax schedules count the optimizer's applied updates (no scheduler object)

    def micro_step(self, batch: dict, loss_scale: float = 1.0) -> None:
        self._step(self.model, self.optimizer, batch["x"], batch["y"], loss_scale)

    def params(self) -> np.ndarray:
        leaves = self.jax.tree.leaves(self.nnx.state(self.model, self.nnx.Param))
        return np.concatenate([np.asarray(self.jax.device_get(p), np.float32).ravel() for p in leaves])

    def compute_dtypes(self) -> dict:
        x = self.jnp.ones((2, FEATURES))
        leaves = self.jax.tree.leaves(self.nnx.state(self.model, self.nnx.Param))
        moments = self.jax.tree.leaves(self.nnx.state(self.optimizer))
        return {"inner": str(self.model.first(x).dtype), "output": str(self.model(x).dtype),
                "params": sorted({str(p.dtype) for p in leaves}),
                "optimizer": sorted({str(m.dtype) for m in moments if self.jnp.issubdtype(m.dtype, self.jnp.floating)})}

    def clip(self, grads: list, max_norm: float) -> dict:
        jnp = self.jnp
        tree = {str(i): jnp.asarray(np.asarray(g, np.float32)) for i, g in enumerate(grads)}
        clipped, norm = self.jax.jit(lambda t: self.acc.clip_grad_norm_(t, max_norm))(tree)
        return {"norm": float(norm), "clipped": [np.asarray(clipped[str(i)]).tolist() for i in range(len(grads))]}


class JaxShardedSetup:
    """The sharded-state setup (`unified.testing.sharding_scenarios.ShardedSetup`) on JAX: three
    NNX layers (one annotated with ``nnx.with_partitioning``, one bias that no process count here
    divides), AdamW, and a jitted step on the global batch."""

    plugin_options: dict = {}
    export_metadata = None
    writes_wait_for_result = False  # Orbax writes from its own thread as soon as the save begins

    def __init__(self, acc: Accelerator, optimizer_first: bool = False) -> None:
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.jax, self.nnx, self.acc, self.allgather = jax, nnx, acc, multihost_utils.process_allgather
        self.batch_sharding = NamedSharding(acc.mesh, PartitionSpec("data"))

        class Model(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.first = nnx.Linear(6, 12, rngs=rngs)
                self.middle = nnx.Linear(12, 6, rngs=rngs, kernel_init=nnx.with_partitioning(
                    nnx.initializers.lecun_normal(), (None, "model")))
                self.last = nnx.Linear(6, 5, rngs=rngs)

            def __call__(self, x):
                return self.last(jnp.tanh(self.middle(jnp.tanh(self.first(x)))))

        # annotated variables are placed when created (flax's eager sharding): under the user's own mesh
        with jax.set_mesh(Mesh(np.array(jax.devices()), ("model",))):
            model = Model(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adamw(0.05), wrt=nnx.Param)
        if optimizer_first:
            self.optimizer, self.model = acc.prepare(optimizer, model)
        else:
            self.model, self.optimizer = acc.prepare(model, optimizer)

        @nnx.jit
        def step(model, optimizer, x, max_norm):
            def loss_fn(m):
                return (m(x).astype(jnp.float32) ** 2).mean()

            grads, norm = acc.clip_grad_norm_(nnx.grad(loss_fn)(model), max_norm)
            optimizer.update(model, grads)
            return norm

        self._step = step

    def step(self, local_rows: np.ndarray, max_norm: float) -> float:
        x = self.jax.make_array_from_process_local_data(self.batch_sharding, local_rows)
        return float(self._step(self.model, self.optimizer, x, max_norm))

    def _full(self, tree) -> dict:
        """name -> the whole array (gathered where it is split: the same order on every process)."""
        leaves = self.jax.tree_util.tree_leaves(tree)
        return {name: np.asarray(leaf) if leaf.is_fully_addressable else np.asarray(self.allgather(leaf, tiled=True))
                for name, leaf in zip(self._full_names(tree), leaves)}

    def full_params(self) -> dict:
        return self._full(self.nnx.state(self.model, self.nnx.Param).to_pure_dict())

    def full_optimizer(self) -> dict:
        return self._full(self.nnx.state(self.optimizer).to_pure_dict())

    def edit_in_place(self, delta: float) -> None:
        """Arrays are immutable: each parameter's value is replaced (placed as it was)."""
        for _, param in self.nnx.iter_graph(self.model):
            if isinstance(param, self.nnx.Param):
                param.value = param.value + delta

    def layout(self) -> dict:
        """Each parameter's partition spec over the mesh; NNX has no units of sharding."""
        state = self.nnx.state(self.model, self.nnx.Param).to_pure_dict()
        placements = {name: [str(leaf.sharding.spec), bool(leaf.sharding.is_fully_replicated)]
                      for name, leaf in zip(self._full_names(state), self.jax.tree_util.tree_leaves(state))}
        return {"placements": placements, "wrapped": []}

    @staticmethod
    def expected_layout(num_processes: int) -> dict:
        """Every kernel and the biases the process count divides are split, the 5-wide bias stays
        whole: the unannotated 6 x 12 kernel along its largest dimension, the 12 x 6 kernel
        annotated ``(None, "model")`` along its annotated dimension, not its largest."""
        if num_processes == 1:
            names = [f"{layer}/{kind}" for layer in ("first", "middle", "last") for kind in ("bias", "kernel")]
            return {"placements": {name: ["P()", True] for name in names}, "wrapped": []}
        return {"placements": {"first/kernel": ["P(None, 'data')", False], "first/bias": ["P('data',)", False],
                               "middle/kernel": ["P(None, 'data')", False], "middle/bias": ["P('data',)", False],
                               "last/kernel": ["P('data',)", False], "last/bias": ["P()", True]}, "wrapped": []}

    @staticmethod
    def shard_file_process(relative: str) -> "int | None":
        """In a folder, Orbax's OCDBT layout: process ``i`` writes the files under
        ``ocdbt.process_<i>/``; on an object store, ``shard-<i>.safetensors`` (backends.jax.storage)."""
        match = re.match(r"ocdbt\.process_(\d+)/", relative) or re.fullmatch(r"shard-(\d{5})\.safetensors", relative)
        return int(match.group(1)) if match else None

    def _full_names(self, tree) -> list:
        return ["/".join(str(getattr(k, "key", k)) for k in path)
                for path, _ in self.jax.tree_util.tree_flatten_with_path(tree)[0]]

    @staticmethod
    def export_names(full: dict) -> dict:
        return {name.replace("/", "."): value for name, value in full.items()}

    @staticmethod
    def unpicklers() -> list:
        return []


class ShardedTable:
    """A registered object holding a global jax.Array split over the processes (rows)."""

    def __init__(self, acc, fill: float) -> None:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        self.sharding = NamedSharding(acc.mesh, PartitionSpec("data"))
        rows = np.full((2, 3), fill + acc.process_index, dtype=np.float32)
        self.table = jax.make_array_from_process_local_data(self.sharding, rows)

    def state_dict(self) -> dict:
        return {"table": self.table, "note": "sharded"}

    def load_state_dict(self, state: dict) -> None:
        self.table = state["table"]

    def mine(self) -> list:
        """This process's rows."""
        return [np.asarray(s.data).tolist() for s in self.table.addressable_shards]

    def same_layout(self) -> bool:
        return self.table.sharding == self.sharding


def local_devices(count: int) -> Dict[str, str]:
    """The environment under which a JAX process holds ``count`` CPU devices: XLA's forced host
    device count added to this process's ``XLA_FLAGS`` (its other flags kept), on the CPU platform."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {"XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={count}"]),
            "JAX_PLATFORMS": "cpu"}


class JaxKit(Kit):
    training = JaxTraining
    loop = JaxSetup
    sharded = JaxShardedSetup
    sharded_table = ShardedTable
    local_devices = staticmethod(local_devices)
