"""Conformance scenarios of ``Accelerator(parallelism_config=...)`` (Accelerate's
`unified.ParallelismConfig`), written once for both backends and run in one group of 4
processes (unified/testing/suite/test_parallelism.py):

- `par_train`: HSDP (``dp_replicate=2 x dp_shard=2``), tensor parallelism (``tp=4``) and
  ``dp_shard=2 x tp=2`` each train a small MLP for a few steps; every process reports its
  ranks, the sample indices of its batches, the whole parameters after training next to
  a reference trained on one process with the global batches (the same init and SGD), and
  what ``gather_for_metrics`` gave over an evaluation epoch of 10 samples (each exactly once).
- `par_resume`: ``dp_shard=2 x tp=2`` saves its (sharded) state mid-epoch, trains on, and a
  fresh run restores it and trains the same steps: the parameters must be identical; then a
  run on another mesh (HSDP ``2 x 2``) loads the same checkpoint.
- `par_checkpoints`: each mesh saves its sharded state, and loads every other mesh's.
- `par_devices_train`, `par_devices_resume`, `par_devices_checkpoints`: the same over 4 devices
  held by 2 processes (2 each; the backend's `Kit.local_devices`), loading the 4 processes' states.

Each backend's side is a small setup class below (`_TorchSetup`, `_JaxSetup`): the model with
its tensor-parallel plan (torch: ``tp_plan``; JAX: ``nnx.with_partitioning`` naming ``tp``),
one SGD step, the whole parameters as NumPy, and the single-process reference.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import unified
from unified import Accelerator, ParallelismConfig
from unified.testing.scenario import scenario

FEATURES, HIDDEN, SAMPLES, BATCH, STEPS, LR = 4, 8, 32, 2, 3, 0.1
MESHES = {"hsdp": (2, 2, 1), "tp": (1, 1, 4), "dp_shard_x_tp": (1, 2, 2), "dp_shard": (1, 4, 1)}
# `par_checkpoints`: SGD with momentum (an optimizer state to compare), 4 steps over 64 samples, so
# every mesh's samples seen (8 x its data ranks) divide every other global batch (a loader resumes)
CKPT_SAMPLES, CKPT_STEPS, MOMENTUM = 64, 4, 0.9


class Samples:
    """Sample ``i``: ``{"x": 4 floats, "y": 1 float, "i": i}``."""

    def __init__(self, n: int = SAMPLES) -> None:
        rng = np.random.default_rng(7)
        self.x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        self.y = (self.x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "i": np.int32(i)}


def _config(sizes: Tuple[int, int, int]) -> ParallelismConfig:
    return ParallelismConfig(dp_replicate_size=sizes[0], dp_shard_size=sizes[1], tp_size=sizes[2])


class _TorchSetup:
    def __init__(self, acc: Accelerator, prepare: bool = True, momentum: float = 0.0) -> None:
        import torch

        self.torch = torch

        class MLP(torch.nn.Module):
            tp_plan = {"fc1": "colwise", "fc2": "rowwise"}

            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.fc1, self.fc2 = torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Linear(HIDDEN, 1)

            def forward(self, x: Any) -> Any:
                return self.fc2(torch.relu(self.fc1(x)))

        self.model = MLP()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=momentum)
        if prepare:
            self.model, self.optimizer = acc.prepare(self.model, self.optimizer)

    def step(self, batch: Dict[str, Any]) -> None:
        torch = self.torch
        x, y = (torch.as_tensor(np.asarray(batch[k])) for k in ("x", "y"))
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def params(self) -> List[np.ndarray]:
        out = []
        for _, p in sorted(self.model.named_parameters()):
            p = p.detach()
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            out.append(p.cpu().numpy().reshape(-1))
        return out

    def optimizer_state(self) -> List[np.ndarray]:
        """Every tensor of the optimizer's state (momentum buffers), whole, in parameter order."""
        out = []
        state = self.optimizer.state_dict()["state"]
        for index in sorted(state):
            for _, value in sorted(state[index].items()):
                if hasattr(value, "detach"):
                    value = value.detach()
                    value = value.full_tensor() if hasattr(value, "full_tensor") else value
                    out.append(value.cpu().numpy().reshape(-1))
        return out


class _JaxSetup:
    def __init__(self, acc: Accelerator, prepare: bool = True, momentum: float = 0.0) -> None:
        import jax
        import optax
        from flax import nnx
        from jax.sharding import Mesh

        self.jax = jax

        class MLP(nnx.Module):
            def __init__(self, rngs: Any) -> None:
                init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
                self.fc1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs,
                                      kernel_init=nnx.with_partitioning(init, (None, "tp")),
                                      bias_init=nnx.with_partitioning(zeros, ("tp",)))
                self.fc2 = nnx.Linear(HIDDEN, 1, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("tp", None)))

            def __call__(self, x: Any) -> Any:
                return self.fc2(jax.nn.relu(self.fc1(x)))

        # the reference: one device of this process, under a mesh with the same axis names
        # (and a plain Accelerator's model: its mesh has no axis these annotations name)
        named = prepare and acc.parallelism_config is not None
        mesh = acc.mesh if named else Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1, 1),
                                           ("dp_replicate", "dp_shard", "tp"))
        with jax.set_mesh(mesh):
            self.model = MLP(nnx.Rngs(0))
            self.optimizer = nnx.Optimizer(self.model, optax.sgd(LR, momentum=momentum or None), wrt=nnx.Param)
        if prepare:
            self.model, self.optimizer = acc.prepare(self.model, self.optimizer)

        @nnx.jit
        def step(model: Any, optimizer: Any, x: Any, y: Any) -> None:
            grads = nnx.grad(lambda m: ((m(x) - y) ** 2).mean())(model)
            optimizer.update(model, grads)

        self._step = step

    def step(self, batch: Dict[str, Any]) -> None:
        x, y = batch["x"], batch["y"]
        if not isinstance(x, self.jax.Array):  # the reference: host batches onto this process's device
            x, y = (self.jax.device_put(np.asarray(v), self.jax.local_devices()[0]) for v in (x, y))
        self._step(self.model, self.optimizer, x, y)

    def params(self) -> List[np.ndarray]:
        from flax import nnx

        return self._whole(nnx.state(self.model, nnx.Param))

    def optimizer_state(self) -> List[np.ndarray]:
        """Every array of the optimizer's state (step count, momentum), whole."""
        from flax import nnx

        return self._whole(nnx.state(self.optimizer))

    def _whole(self, tree: Any) -> List[np.ndarray]:
        from flax import nnx
        from jax.experimental import multihost_utils

        state = nnx.to_flat_state(tree)
        out = []
        for _, variable in sorted(state, key=lambda item: str(item[0])):
            value = variable.get_value()
            if not value.is_fully_addressable:
                value = multihost_utils.process_allgather(value, tiled=True)
            out.append(np.asarray(value).reshape(-1))
        return out


def _setup(acc: Accelerator, prepare: bool = True, momentum: float = 0.0) -> Any:
    setups = {"torch": _TorchSetup, "jax": _JaxSetup}
    if acc.backend not in setups:
        raise LookupError(f"parallel_scenarios has no model setup for the {acc.backend!r} backend")
    return setups[acc.backend](acc, prepare, momentum)


def _indices(batch: Dict[str, Any]) -> List[int]:
    """This process's sample indices of a prepared batch (of a global jax.Array: the rows its
    devices hold, in order, each once)."""
    return [i for rows in _rows_by_rank(batch).values() for i in rows]


def _rows_by_rank(batch: Dict[str, Any]) -> Dict[int, List[int]]:
    """This process's sample indices of a prepared batch by data-parallel rank: of a global
    jax.Array, the rows each of its devices holds (a device's place in the batch: the data rank
    of its mesh position; devices of one tensor-parallel group hold the same rows, once here);
    otherwise all of them, at key 0."""
    value = batch["i"]
    shards = getattr(value, "addressable_shards", None)
    if shards is None:
        return {0: [int(v) for v in np.asarray(value).reshape(-1)]}
    out: Dict[int, List[int]] = {}
    for shard in shards:
        rows = shard.index[0] if shard.index else slice(None)
        start, stop = rows.start or 0, rows.stop if rows.stop is not None else value.shape[0]
        out.setdefault(start // max(1, stop - start), [int(v) for v in np.asarray(shard.data).reshape(-1)])
    return dict(sorted(out.items()))


def _host(value: Any) -> List[int]:
    """The values of a gathered array (a torch tensor, or a global jax.Array) as a list."""
    if hasattr(value, "is_fully_addressable") and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        value = multihost_utils.process_allgather(value, tiled=True)
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _reference(acc: Accelerator, data_size: int, steps: int, samples: int = SAMPLES,
               momentum: float = 0.0) -> List[np.ndarray]:
    """The parameters after ``steps`` SGD steps on one process over the global batches
    (``BATCH * data_size`` rows: the prepared loaders' global order, unprepared)."""
    setup = _setup(acc, prepare=False, momentum=momentum)
    loader = unified.DataLoader(Samples(samples), batch_size=BATCH * data_size, shuffle=True, seed=0)
    for n, batch in enumerate(loader):
        if n == steps:
            break
        setup.step(batch)
    return setup.params()


def _difference(a: List[np.ndarray], b: List[np.ndarray]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")  # another structure: nothing equal
    return float(max((np.max(np.abs(x - y)) for x, y in zip(a, b) if x.size), default=0.0))


def _train(acc: Accelerator, setup: Any, loader: Any, steps: int,
           by_rank: Optional[List[Dict[str, List[int]]]] = None) -> List[List[int]]:
    seen = []
    for n, batch in enumerate(loader):
        seen.append(_indices(batch))
        if by_rank is not None:
            by_rank.append({str(rank): rows for rank, rows in _rows_by_rank(batch).items()})
        setup.step(batch)
        if n + 1 == steps:
            break
    return seen


@scenario(requires=("TrainingObjects", "TrainingLoop", "ShardedTraining"), processes=(4,))
def par_train(state: dict) -> dict:
    """Each mesh of `MESHES`: ranks, batches and the parameters against the reference."""
    out: Dict[str, Any] = {}
    for name, sizes in MESHES.items():
        config = _config(sizes)
        acc = Accelerator(parallelism_config=config, timeout=60)
        setup = _setup(acc)
        loader = acc.prepare(unified.DataLoader(Samples(), batch_size=BATCH, shuffle=True, seed=0))
        by_rank: List[Dict[str, List[int]]] = []
        seen = _train(acc, setup, loader, STEPS, by_rank)
        trained = setup.params()
        fresh = acc.prepare(unified.DataLoader(Samples(), batch_size=BATCH, shuffle=True, seed=0))
        skipped = _indices(next(iter(acc.skip_first_batches(fresh, 1))))
        evaluation = acc.prepare(unified.DataLoader(Samples(10), batch_size=BATCH, shuffle=False))
        gathered = [i for batch in evaluation for i in _host(acc.gather_for_metrics(batch["i"]))]
        out[name] = {
            "gathered": gathered,
            "skipped_to_second": skipped == seen[1],
            "ranks": [acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank],
            "batches": seen,
            "by_rank": by_rank,
            "global_batch": loader.global_batch_size,
            # one process on the global batches: the data-parallel ranks' rows together
            "difference": _difference(trained, _reference(acc, loader.global_batch_size // BATCH, STEPS)),
            "moved": _difference(trained, _setup(acc, prepare=False).params()),
            "mesh": _mesh_names(acc),
        }
        state["acc"] = acc
    return out


def _mesh_names(acc: Accelerator) -> Dict[str, List[str]]:
    """The mesh's dimension names, and the flattened views a torch ``DeviceMesh`` has."""
    mesh = acc.torch_device_mesh
    if mesh is not None:
        return {"axes": list(mesh.mesh_dim_names),
                "views": sorted(n for n in ("dp", "dp_shard_cp", "dp_cp") if _has_view(mesh, n))}
    return {"axes": list(acc.mesh.axis_names), "views": []}


def _has_view(mesh: Any, name: str) -> bool:
    try:
        mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


@scenario(requires=("TrainingObjects", "TrainingLoop", "ShardedTraining"), processes=(4,))
def par_resume(state: dict) -> dict:
    """``dp_shard=2 x tp=2``: save after 2 steps, 2 more; a fresh run restores and trains the
    same 2 steps; then HSDP ``2 x 2`` loads the checkpoint (another mesh)."""
    return _resume(state, os.path.join(os.environ["UNIFIED_TEST_SHARED"], "parallel_resume"))


def _resume(state: dict, folder: str) -> dict:
    config = _config(MESHES["dp_shard_x_tp"])
    acc = Accelerator(parallelism_config=config, project_dir=folder, timeout=60)
    setup = _setup(acc)
    loader = acc.prepare(unified.DataLoader(Samples(), batch_size=BATCH, shuffle=True, seed=0))
    _train(acc, setup, loader, 2)
    acc.save_state(os.path.join(folder, "step2"))
    saved = setup.params()
    after = _train(acc, setup, loader, 2)
    uninterrupted = setup.params()

    resumed_acc = Accelerator(parallelism_config=_config(MESHES["dp_shard_x_tp"]), project_dir=folder, timeout=60)
    resumed = _setup(resumed_acc)
    resumed_loader = resumed_acc.prepare(unified.DataLoader(Samples(), batch_size=BATCH, shuffle=True, seed=0))
    resumed_acc.load_state(os.path.join(folder, "step2"))
    restored = resumed.params()
    resumed_after = _train(resumed_acc, resumed, resumed_loader, 2)

    other = Accelerator(parallelism_config=_config(MESHES["hsdp"]), project_dir=folder, timeout=60)
    moved = _setup(other)
    other.prepare(unified.DataLoader(Samples(), batch_size=BATCH, shuffle=True, seed=0))
    error = None
    try:
        other.load_state(os.path.join(folder, "step2"))
        other_difference = _difference(moved.params(), saved)
    except Exception as err:  # reported, not raised: the test says what failed
        error, other_difference = f"{type(err).__name__}: {err}"[:600], None
    state["acc"] = other
    return {"restored_difference": _difference(restored, saved),
            "resumed_difference": _difference(resumed.params(), uninterrupted),
            "same_batches": after == resumed_after,
            "other_mesh_difference": other_difference, "other_mesh_error": error}


def _checkpoint_folder(layout: str = "") -> str:
    """Where `par_checkpoints` (``layout`` ""), or the group of another layout (e.g.
    ``"devices"``: `par_devices_checkpoints`), saves each mesh's state."""
    return os.path.join(os.environ["UNIFIED_TEST_SHARED"], "parallel_checkpoints" + (f"_{layout}" if layout else ""))


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:1500]


def _model_file(path: str) -> List[np.ndarray]:
    """The arrays of a ``save_model`` file, by name (the order `params` sorts them in)."""
    from safetensors.numpy import load_file

    arrays = load_file(path)
    return [np.asarray(arrays[name]).reshape(-1) for name in sorted(arrays)]


def _load_every(acc: Accelerator, setup: Any, loader: Any, saved: Dict[str, Optional[Dict[str, List[np.ndarray]]]],
                skip: str = "", folders: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, Any]]:
    """Load each mesh's saved state (but ``skip``'s) into ``setup``; how far its parameters and
    optimizer state are from what was saved; then one step on the loaded state (it must train on:
    the optimizer's state placed as this run's parameters). ``saved`` names the sources; a
    source's state is in ``folders[source]`` (default: `par_checkpoints`' folder of that mesh)."""
    out: Dict[str, Dict[str, Any]] = {}
    for source in saved:
        if source == skip:
            continue
        if saved[source] is None:
            out[source] = {"params": None, "optimizer": None,
                           "error": f"no state of {source} was saved before this ran"}
            continue
        try:
            folder = (folders or {}).get(source) or os.path.join(_checkpoint_folder(), source)
            acc.load_state(os.path.join(folder, "state"))
            out[source] = {"params": _difference(setup.params(), saved[source]["params"]),
                           "optimizer": _difference(setup.optimizer_state(), saved[source]["optimizer"]),
                           "error": None}
            setup.step(next(iter(loader)))
        except Exception as err:  # reported, not raised: the test says which pair failed
            out[source] = {"params": None, "optimizer": None, "error": _error(err)}
    return out


@scenario(requires=("TrainingObjects", "TrainingLoop", "ShardedTraining"), processes=(4,))
def par_checkpoints(state: dict) -> dict:
    """Each mesh of `MESHES` trains (SGD with momentum) and saves its sharded state and its
    consolidated model (``save_model``); then each mesh loads every other mesh's state. Reports
    the differences (parameters, optimizer state) from the saved values, gathered whole, and how
    far each ``model.safetensors`` is from the trained parameters and the one-process reference.
    The main process writes the saved values (``saved_<mesh>.npz``) for `par_checkpoints_one`."""
    return _checkpoints(state, "")


def _checkpoints(state: dict, layout: str, others: Optional[str] = None) -> dict:
    """`par_checkpoints` saving in ``layout``'s folder; the meshes also load the states the
    group of layout ``others`` saved (``None``: none), reported as ``"<others>/<mesh>"``
    (``"processes/<mesh>"`` for `par_checkpoints`' own folder, ``others=""``)."""
    folder = _checkpoint_folder(layout)
    saved: Dict[str, Dict[str, List[np.ndarray]]] = {}
    models: Dict[str, Any] = {}
    for name, sizes in MESHES.items():
        config = _config(sizes)
        acc = Accelerator(parallelism_config=config, project_dir=os.path.join(folder, name), timeout=60)
        setup = _setup(acc, momentum=MOMENTUM)
        loader = acc.prepare(unified.DataLoader(Samples(CKPT_SAMPLES), batch_size=BATCH, shuffle=True, seed=0))
        _train(acc, setup, loader, CKPT_STEPS)
        global_batch = loader.global_batch_size
        acc.save_state(os.path.join(folder, name, "state"))
        saved[name] = {"params": setup.params(), "optimizer": setup.optimizer_state()}
        model: Dict[str, Any] = {"error": None}
        try:
            path = acc.save_model(setup.model, os.path.join(folder, name, "model"))
            if acc.is_main_process:
                written = _model_file(path)
                model["trained"] = _difference(written, saved[name]["params"])
                model["reference"] = _difference(written, _reference(
                    acc, global_batch // BATCH, CKPT_STEPS, CKPT_SAMPLES, MOMENTUM))
        except Exception as err:  # reported, not raised
            model["error"] = _error(err)
        models[name] = model
        if acc.is_main_process:
            arrays = {f"{kind}_{i}": a for kind in ("params", "optimizer") for i, a in enumerate(saved[name][kind])}
            np.savez(os.path.join(folder, f"saved_{name}.npz"), **arrays)
        acc.wait_for_everyone()
        state["acc"] = acc
    other: Dict[str, Optional[Dict[str, List[np.ndarray]]]] = {}
    folders: Dict[str, str] = {name: os.path.join(folder, name) for name in MESHES}  # this group's own states
    if others is not None:
        label = others or "processes"
        for name in MESHES:  # None: that group saved nothing here (it did not run first)
            there = os.path.exists(os.path.join(_checkpoint_folder(others), f"saved_{name}.npz"))
            other[f"{label}/{name}"] = _saved(name, others) if there else None
            folders[f"{label}/{name}"] = os.path.join(_checkpoint_folder(others), name)
    loads = {}
    for name, sizes in MESHES.items():
        acc = Accelerator(parallelism_config=_config(sizes), project_dir=os.path.join(folder, f"load_{name}"),
                          timeout=60)
        setup = _setup(acc, momentum=MOMENTUM)
        loader = acc.prepare(unified.DataLoader(Samples(CKPT_SAMPLES), batch_size=BATCH, shuffle=True, seed=0))
        loads[name] = _load_every(acc, setup, loader, {**saved, **other}, skip=name, folders=folders)
        state["acc"] = acc
    return {"models": models, "loads": loads}


def _saved(name: str, layout: str = "") -> Dict[str, List[np.ndarray]]:
    """What the group of ``layout`` saved on mesh ``name`` (its main process's ``saved_<mesh>.npz``)."""
    with np.load(os.path.join(_checkpoint_folder(layout), f"saved_{name}.npz")) as arrays:
        return {kind: [arrays[k] for k in sorted((k for k in arrays.files if k.startswith(kind + "_")),
                                                  key=lambda k: int(k.rsplit("_", 1)[1]))]
                for kind in ("params", "optimizer")}


@scenario(requires=("TrainingObjects", "TrainingLoop", "ShardedTraining"), processes=(1,))
def par_checkpoints_one(state: dict) -> dict:
    """One plain process (``parallelism_config=None``) loads the state `par_checkpoints` saved on
    each mesh (run after it, sharing its folder)."""
    acc = Accelerator(parallelism_config=None, project_dir=os.path.join(_checkpoint_folder(), "load_one"))
    setup = _setup(acc, momentum=MOMENTUM)
    loader = acc.prepare(unified.DataLoader(Samples(CKPT_SAMPLES), batch_size=BATCH, shuffle=True, seed=0))
    state["acc"] = acc
    saved, folders = {name: _saved(name) for name in MESHES}, {}
    for name in MESHES:  # and those of the group whose processes hold several devices, where it ran
        if os.path.exists(os.path.join(_checkpoint_folder(DEVICES), f"saved_{name}.npz")):
            saved[f"{DEVICES}/{name}"] = _saved(name, DEVICES)
            folders[f"{DEVICES}/{name}"] = os.path.join(_checkpoint_folder(DEVICES), name)
    return {"loads": _load_every(acc, setup, loader, saved, folders=folders)}


# -- several devices per process --------------------------------------------------------------------
# The same meshes over 4 devices held by 2 processes (2 each): the scenarios above, run by a group
# of 2 processes each started with its backend's `Kit.local_devices(2)` (JAX: 2 CPU devices from
# XLA_FLAGS), so a backend that cannot give a process several devices skips them, saying why. A
# process holds consecutive positions of the mesh: on HSDP 2 x 2 and dp_shard 4 its two devices
# are two data-parallel ranks, which split its batch; on dp_shard 2 x tp 2 one tensor-parallel
# group; on tp 4 half of one. The group saves in its own folders and loads the states the 4
# processes saved (run after `par_checkpoints`, sharing its folder).
DEVICES = "devices"
DEVICES_PER_PROCESS = 2
_DEVICE_NEEDS = dict(requires=("TrainingObjects", "TrainingLoop", "ShardedTraining"), kit=("local_devices",),
                     processes=(2,))


@scenario(**_DEVICE_NEEDS)
def par_devices_train(state: dict) -> dict:
    """`par_train` on 2 processes of 2 devices each."""
    return par_train(state)


@scenario(**_DEVICE_NEEDS)
def par_devices_resume(state: dict) -> dict:
    """`par_resume` on 2 processes of 2 devices each (its own folder)."""
    return _resume(state, os.path.join(os.environ["UNIFIED_TEST_SHARED"], f"parallel_resume_{DEVICES}"))


@scenario(**_DEVICE_NEEDS)
def par_devices_checkpoints(state: dict) -> dict:
    """`par_checkpoints` on 2 processes of 2 devices each: every mesh saves, then loads every
    other mesh's state of this group and every mesh's state of the 4 processes
    (``"processes/<mesh>"``)."""
    return _checkpoints(state, DEVICES, others="")
