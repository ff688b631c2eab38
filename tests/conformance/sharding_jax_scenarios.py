"""Conformance scenarios of sharded state (contract Part 2, "Sharded state"), written once; each
backend's side is a small setup named by its profile's ``sharded_setup`` (a backend without one
skips the suite). Run by tests/conformance/test_sharding.py.

The saving group writes what it saved (full values) into the shared folder with ``np.savez``;
groups of another size load the checkpoint and compare. No pickle anywhere.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np

import unified
from unified import Accelerator, FullyShardedDataParallelPlugin
from unified.registry import load_object

ROWS = 12  # the global batch: divisible by 1, 2 and 3 processes
STEPS = 3


def _shared(name: str) -> str:
    return os.path.join(os.environ["UNIFIED_TEST_SHARED"], name)


def _setup_class(acc: Accelerator):
    from profiles import profile

    return load_object(profile(acc.backend).sharded_setup)


def global_batch(step: int) -> np.ndarray:
    return np.random.default_rng(100 + step).normal(size=(ROWS, 6)).astype(np.float32)


def _local_rows(acc: Accelerator, batch: np.ndarray) -> np.ndarray:
    per = ROWS // acc.num_processes
    return batch[acc.process_index * per:(acc.process_index + 1) * per]


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) if a[k].size else 0.0
               for k in a)


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def _train(setup, acc: Accelerator, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        setup.step(_local_rows(acc, global_batch(step)))


def shard_train_and_save(state: dict) -> dict:
    """Sharded parameters, training equal to the replicated run (also with bf16 and accumulation),
    a sharded checkpoint, and a consolidated save_model."""
    plugin = FullyShardedDataParallelPlugin()
    sharded_acc = Accelerator(timeout=60, fsdp_plugin=plugin)
    Setup = _setup_class(sharded_acc)
    sharded = Setup(sharded_acc)
    placements = sharded.placements()
    replicated_acc = Accelerator(timeout=60)
    replicated = Setup(replicated_acc)
    initial_equal = _equal(sharded.full_params(), replicated.full_params())
    _train(sharded, sharded_acc, STEPS)
    _train(replicated, replicated_acc, STEPS)
    result = {
        "placements": placements, "placements_after_training": sharded.placements(),
        "initial_equal": initial_equal,
        "params_vs_replicated": _max_diff(sharded.full_params(), replicated.full_params()),
        "optimizer_vs_replicated": _max_diff(sharded.full_optimizer(), replicated.full_optimizer()),
    }
    # bf16 compute and gradient accumulation (2 micro-batches per step) on sharded state
    loop = {}
    for name, kwargs in (("bf16", {"mixed_precision": "bf16"}), ("accumulation", {"gradient_accumulation_steps": 2})):
        a = Accelerator(timeout=60, fsdp_plugin=plugin, **kwargs)
        b = Accelerator(timeout=60, **kwargs)
        sa, sb = Setup(a), Setup(b)
        for step in range(4):
            with a.accumulate(sa.model):
                sa.step(_local_rows(a, global_batch(step)))
            with b.accumulate(sb.model):
                sb.step(_local_rows(b, global_batch(step)))
        loop[name] = {"params": _max_diff(sa.full_params(), sb.full_params()),
                      "still_sharded": sa.placements(), "moved": _max_diff(sa.full_params(), Setup(b).full_params())}
    result["loop"] = loop
    # the checkpoint, what it holds, and the next step after it
    path = sharded_acc.save_state(_shared(f"sharded_{sharded_acc.num_processes}"))
    params, optimizer = sharded.full_params(), sharded.full_optimizer()
    _train(sharded, sharded_acc, 1, first=STEPS)
    _write_expected(sharded_acc, params, optimizer, sharded.full_params())
    # a second checkpoint of the same run, to take a "shard from another checkpoint" from
    sharded_acc.save_state(_shared(f"other_{sharded_acc.num_processes}"))
    # consolidated export: every process calls save_model
    exported = sharded_acc.save_model(sharded.model, _shared(f"export_{sharded_acc.num_processes}"))
    result["exported"] = exported
    mine = sharded.full_params()  # a collective: every process
    if sharded_acc.is_main_process:
        from safetensors.numpy import load_file

        written = load_file(exported)
        result["export_equal"] = sorted(written) == sorted(sharded.export_names(mine)) and all(
            np.array_equal(written[n], v) for n, v in sharded.export_names(mine).items())
    files = sorted(n for n in json.load(open(os.path.join(path, "manifest.json")))["files"])
    result["manifest_files"] = files
    if sharded_acc.is_main_process:
        from safetensors.numpy import load_file

        result["model_file_tensors"] = sorted(load_file(os.path.join(path, "model_0.safetensors")))
    result["on_disk"] = sorted(os.path.relpath(os.path.join(folder, n), path) for folder, _, names in os.walk(path)
                               for n in names)
    sharded_acc.wait_for_everyone()
    return result


def shard_async_save(_: dict) -> dict:
    """``save_state(async_save=True)`` of sharded state: it returns before the checkpoint is
    committed (the background write is held until the test lets it go), a training step right
    after the call does not reach the checkpoint, a load after ``wait_for_checkpoint`` restores
    the values of the call. Then a write that fails on process 1 only: ``wait_for_checkpoint``
    fails on every process and nothing is committed."""
    import threading

    acc = Accelerator(timeout=60, fsdp_plugin=FullyShardedDataParallelPlugin())
    setup = _setup_class(acc)(acc)
    _train(setup, acc, 1)
    params, optimizer = setup.full_params(), setup.full_optimizer()
    gate, seen = threading.Event(), {}
    undo = _hold_sharded_writes(acc, gate, seen)
    final = _shared(f"async_{acc.num_processes}")
    start = time.monotonic()
    acc.save_state(final, async_save=True)
    returned_in = time.monotonic() - start
    at_return = {"committed": os.path.exists(final), "write_returned": "gate_opened" in seen}
    _train(setup, acc, 1, first=STEPS)  # the optimizer updates the sharded state right away
    moved = _max_diff(setup.full_params(), params)
    gate.set()
    acc.wait_for_checkpoint()
    undo()
    committed = os.path.exists(os.path.join(final, "manifest.json"))
    acc.load_state(final)
    result = {"returned_in": returned_in, "at_return": at_return, "write_thread": seen.get("thread"),
              "gate_opened": seen.get("gate_opened"), "committed": committed, "moved": moved,
              "params_equal": _equal(setup.full_params(), params),
              "optimizer_equal": _equal(setup.full_optimizer(), optimizer)}
    # a background write that fails on process 1 only (after Orbax's own write, so no process
    # waits for it at Orbax's barriers)
    gate, failed_seen = threading.Event(), {}
    gate.set()
    undo = _hold_sharded_writes(acc, gate, failed_seen, fail=acc.process_index == 1)
    failing = _shared(f"async_failed_{acc.num_processes}")
    acc.save_state(failing, async_save=True)
    try:
        acc.wait_for_checkpoint()
        result["failure"] = None
    except unified.CheckpointError as err:
        result["failure"] = str(err)
    undo()
    result["failure_leftovers"] = sorted(n for n in os.listdir(os.path.dirname(failing))
                                         if os.path.basename(failing) in n)
    result["untouched_by_failure"] = _equal(setup.full_params(), params)
    return result


def _hold_sharded_writes(acc, gate, seen: dict, fail: bool = False):
    from held_writes import hold_sharded_writes  # the worker's folder is on sys.path

    return hold_sharded_writes(acc, gate, seen, fail)


def _write_expected(acc: Accelerator, params: dict, optimizer: dict, after_next_step: dict) -> None:
    """What a checkpoint holds, in full, and the parameters one step later (main process)."""
    if acc.is_main_process:
        np.savez(_shared(f"expected_{acc.num_processes}.npz"),
                 **{f"p/{k}": v for k, v in params.items()}, **{f"o/{k}": v for k, v in optimizer.items()},
                 **{f"n/{k}": v for k, v in after_next_step.items()})


def _expected(saved_by: int) -> dict:
    with np.load(_shared(f"expected_{saved_by}.npz"), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _load_and_continue(saved_by: int) -> dict:
    acc = Accelerator(timeout=60, fsdp_plugin=FullyShardedDataParallelPlugin())
    Setup = _setup_class(acc)
    setup = Setup(acc)
    _train(setup, acc, 1, first=50)  # different from what was saved
    acc.load_state(_shared(f"sharded_{saved_by}"))
    expected = _expected(saved_by)
    params, optimizer = setup.full_params(), setup.full_optimizer()
    result = {
        "placements": setup.placements(),
        "params_equal": _equal(params, {k[2:]: v for k, v in expected.items() if k.startswith("p/")}),
        "optimizer_equal": _equal(optimizer, {k[2:]: v for k, v in expected.items() if k.startswith("o/")}),
    }
    _train(setup, acc, 1, first=STEPS)
    result["next_step"] = _max_diff(setup.full_params(), {k[2:]: v for k, v in expected.items() if k.startswith("n/")})
    state["acc"], state["setup"] = acc, setup
    return result


state: dict = {}


def shard_load_from_2(_: dict) -> dict:
    return _load_and_continue(2)


def shard_load_from_3(_: dict) -> dict:
    return _load_and_continue(3)


def shard_save_here(_: dict) -> dict:
    """Save what was loaded (and trained one step) as this group's checkpoint, for the next group."""
    acc, setup = state["acc"], state["setup"]
    path = acc.save_state(_shared(f"sharded_{acc.num_processes}"))
    params, optimizer = setup.full_params(), setup.full_optimizer()
    _train(setup, acc, 1, first=STEPS)
    _write_expected(acc, params, optimizer, setup.full_params())
    acc.wait_for_everyone()
    return {"saved": path}


def _damaged_copies(pristine: str, other: str, root: str) -> dict:
    """case -> the file the error must name: a flipped byte in a shard file, a missing shard
    file, the shard files of another checkpoint of the same run."""
    shards = sorted(os.path.relpath(os.path.join(folder, n), pristine)
                    for folder, _, names in os.walk(os.path.join(pristine, [d for d in os.listdir(pristine)
                                                                             if d.startswith("sharded.")][0]))
                    for n in names)
    largest = max(shards, key=lambda n: os.path.getsize(os.path.join(pristine, n)))
    cases = {}
    target = os.path.join(root, "flipped_byte")
    shutil.copytree(pristine, target)
    with open(os.path.join(target, largest), "r+b") as handle:
        size = os.path.getsize(os.path.join(target, largest))
        handle.seek(size // 2)
        byte = handle.read(1)
        handle.seek(size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    cases["flipped_byte"] = largest
    target = os.path.join(root, "missing_shard")
    shutil.copytree(pristine, target)
    os.remove(os.path.join(target, largest))
    cases["missing_shard"] = largest
    # another checkpoint's shard folder (same run, one step later) in place of this one's
    target = os.path.join(root, "other_checkpoint")
    shutil.copytree(pristine, target)
    sharded_dir = largest.split("/")[0]
    shutil.rmtree(os.path.join(target, sharded_dir))
    shutil.copytree(os.path.join(other, sharded_dir), os.path.join(target, sharded_dir))
    cases["other_checkpoint"] = sharded_dir
    return cases


def shard_damaged(_: dict) -> dict:
    """Damaged copies of the 2-process checkpoint, loaded by this group: each a CheckpointError
    naming the file, with nothing restored."""
    acc, setup = state["acc"], state["setup"]
    root = _shared(f"damaged_{acc.num_processes}")
    cases = None
    if acc.is_main_process:
        cases = _damaged_copies(_shared("sharded_2"), _shared("other_2"), root)
    cases = acc._collectives.broadcast_json(cases)
    out = {}
    for case, culprit in sorted(cases.items()):
        before_p, before_o = setup.full_params(), setup.full_optimizer()
        try:
            acc.load_state(os.path.join(root, case))
            out[case] = {"raised": None}
        except unified.CheckpointError as err:
            out[case] = {"raised": "CheckpointError", "message": str(err), "culprit": culprit}
        out[case]["untouched"] = _equal(before_p, setup.full_params()) and _equal(before_o, setup.full_optimizer())
    return out


class JaxShardedSetup:
    """Three NNX layers (one annotated with ``nnx.with_partitioning``, one bias that no device
    count here divides), AdamW, and a jitted step on the global batch."""

    def __init__(self, acc: Accelerator) -> None:
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
        self.model, self.optimizer = acc.prepare(model, optimizer)

        @nnx.jit
        def step(model, optimizer, x):
            def loss_fn(m):
                return (m(x).astype(jnp.float32) ** 2).mean()

            optimizer.update(model, nnx.grad(loss_fn)(model))

        self._step = step

    def step(self, local_rows: np.ndarray) -> None:
        x = self.jax.make_array_from_process_local_data(self.batch_sharding, local_rows)
        self._step(self.model, self.optimizer, x)

    def _full(self, tree) -> dict:
        """name -> the whole array (gathered where it is split: the same order on every process)."""
        leaves = self.jax.tree_util.tree_leaves(tree)
        return {name: np.asarray(leaf) if leaf.is_fully_addressable else np.asarray(self.allgather(leaf, tiled=True))
                for name, leaf in zip(self._full_names(tree), leaves)}

    def full_params(self) -> dict:
        return self._full(self.nnx.state(self.model, self.nnx.Param).to_pure_dict())

    def full_optimizer(self) -> dict:
        return self._full(self.nnx.state(self.optimizer).to_pure_dict())

    def placements(self) -> dict:
        """name -> [partition spec, fully replicated?] of every parameter."""
        state = self.nnx.state(self.model, self.nnx.Param).to_pure_dict()
        return {name: [str(leaf.sharding.spec), bool(leaf.sharding.is_fully_replicated)]
                for name, leaf in zip(self._full_names(state), self.jax.tree_util.tree_leaves(state))}

    def _full_names(self, tree) -> list:
        return ["/".join(str(getattr(k, "key", k)) for k in path)
                for path, _ in self.jax.tree_util.tree_flatten_with_path(tree)[0]]

    @staticmethod
    def export_names(full: dict) -> dict:
        return {name.replace("/", "."): value for name, value in full.items()}
