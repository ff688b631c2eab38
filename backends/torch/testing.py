"""The PyTorch backend's testing kit: the tiny training setups the conformance suite
(`unified.testing`) runs on PyTorch. Imported only by the suite (`BackendSpec.testing_kit`); every
framework import is inside the setups."""
from __future__ import annotations

import hashlib
import random
import re

import numpy as np

from unified import Accelerator
from unified.testing import Kit
from unified.testing.loop_scenarios import FEATURES
from unified.testing.training import Counter, host_noise


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
        x = (torch.randn(4, 6) * host_noise()).to(self.acc.device)  # drawn on CPU: the same on every device
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
            layer.weight = torch.nn.Parameter(torch.zeros(8, 7, device=layer.weight.device))

    def param_hash(self) -> str:
        digest = hashlib.sha256()
        for tensor in self.acc.unwrap_model(self.model).state_dict().values():
            digest.update(tensor.detach().cpu().numpy().tobytes())
        digest.update(repr(self.counter.history.tolist()).encode())
        return digest.hexdigest()


class TorchSetup:
    returns_float32 = True  # a prepared forward returns float32 under autocast, as in Accelerate

    def __init__(self, acc: Accelerator, lr: float = 0.05) -> None:
        import torch

        self.torch, self.acc = torch, acc
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # counts its steps only
        self.model, self.optimizer, self.scheduler = acc.prepare(model, optimizer, scheduler)

    def micro_step(self, batch: dict, loss_scale: float = 1.0) -> None:
        """Forward, backward, (clip at a boundary,) step and zero_grad, Accelerate style."""
        loss = (self.model(batch["x"]) - batch["y"]).pow(2).mean() * loss_scale
        self.acc.backward(loss)
        if self.acc.sync_gradients:
            self.acc.clip_grad_norm_(self.model.parameters(), 1e6)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def scheduler_steps(self) -> int:
        """How often the user's scheduler really stepped."""
        return self.scheduler.scheduler.last_epoch

    def params(self) -> np.ndarray:
        return np.concatenate([p.detach().float().cpu().numpy().ravel()
                               for p in self.acc.unwrap_model(self.model).parameters()])

    def compute_dtypes(self) -> dict:
        """Inside the prepared forward (a hook on the first layer) and what the forward returns."""
        seen = {}
        inner = self.acc.unwrap_model(self.model)[0]
        handle = inner.register_forward_hook(lambda module, args, out: seen.update(inner=str(out.dtype)))
        out = self.model(self.torch.ones(2, FEATURES, device=self.acc.device))
        handle.remove()
        return {"inner": seen["inner"].replace("torch.", ""), "output": str(out.dtype).replace("torch.", ""),
                "params": sorted({str(p.dtype).replace("torch.", "") for p in self.model.parameters()})}

    def clip(self, grads: list, max_norm: float) -> dict:
        torch = self.torch
        params = [torch.nn.Parameter(torch.zeros(np.shape(g))) for g in grads]
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g, dtype=torch.float32)
        norm = self.acc.clip_grad_norm_(params, max_norm)
        return {"norm": float(norm), "clipped": [p.grad.numpy().tolist() for p in params]}


class TorchShardedSetup:
    """The sharded-state setup (`unified.testing.sharding_scenarios.ShardedSetup`) on FSDP2: a
    ``Linear``, two ``Block`` layers (wrapped one by one: ``transformer_cls_names_to_wrap``),
    a ``Linear``, and AdamW; DTensor parameters gathered with ``full_tensor``."""

    plugin_options = {"transformer_cls_names_to_wrap": ["Block"]}
    export_metadata = {"format": "pt"}  # transformers' loaders check it
    writes_wait_for_result = True  # DCP's file writes are the ShardedWrite's (`begin_sharded_save`)

    def __init__(self, acc: Accelerator, optimizer_first: bool = False) -> None:
        import torch

        self.torch, self.acc = torch, acc

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x):
                return torch.tanh(self.lin(x))

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), Block(), Block(), torch.nn.Linear(8, 5))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        if optimizer_first:
            self.optimizer, self.model = acc.prepare(optimizer, model)
        else:
            self.model, self.optimizer = acc.prepare(model, optimizer)

    def step(self, local_rows: np.ndarray, max_norm: float) -> "float | None":
        loss = (self.model(self.torch.from_numpy(local_rows).to(self.acc.device)).float() ** 2).mean()
        self.acc.backward(loss)
        norm = float(self.acc.clip_grad_norm_(self.model.parameters(), max_norm)) if self.acc.sync_gradients else None
        self.optimizer.step()
        self.optimizer.zero_grad()
        return norm

    def _named(self) -> list:
        return list(self.acc.unwrap_model(self.model).named_parameters())

    @staticmethod
    def _full(tensor) -> np.ndarray:
        """The whole tensor (a collective for a DTensor)."""
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        return whole.detach().cpu().numpy().copy()

    def full_params(self) -> dict:
        return {name: self._full(p) for name, p in self._named()}

    def full_optimizer(self) -> dict:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return {f"{name}/{key}": self._full(value) for name, p in self._named()
                for key, value in sorted(inner.state.get(p, {}).items()) if self.torch.is_tensor(value)}

    def edit_in_place(self, delta: float) -> None:
        with self.torch.no_grad():
            for _, p in self._named():
                p.add_(delta)

    def layout(self) -> dict:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import Shard

        placements = {}
        for name, p in self._named():
            kinds = getattr(p, "placements", None)
            placements[name] = (["whole", True] if kinds is None else
                                [", ".join(map(str, kinds)), not any(isinstance(k, Shard) for k in kinds)])
        wrapped = sorted(name or "<root>" for name, m in self.acc.unwrap_model(self.model).named_modules()
                         if isinstance(m, FSDPModule))
        return {"placements": placements, "wrapped": wrapped}

    @staticmethod
    def expected_layout(num_processes: int) -> dict:
        """FSDP2 splits every parameter along its first dimension (padding the last shard);
        the Blocks are units of their own, then the root. With one process the model stays whole."""
        names = [f"{layer}.{kind}" for layer in ("0", "1.lin", "2.lin", "3") for kind in ("weight", "bias")]
        if num_processes == 1:
            return {"placements": {name: ["whole", True] for name in names}, "wrapped": []}
        return {"placements": {name: ["S(0)", False] for name in names}, "wrapped": ["1", "2", "<root>"]}

    @staticmethod
    def shard_file_process(relative: str) -> "int | None":
        """DCP's safetensors layout: process ``i`` writes ``shard-<i + 1>-model-00001-of-00001.safetensors``."""
        match = re.fullmatch(r"shard-(\d{5})-model-\d{5}-of-\d{5}\.safetensors", relative)
        return int(match.group(1)) - 1 if match else None

    @staticmethod
    def export_names(full: dict) -> dict:
        return dict(full)

    @staticmethod
    def unpicklers() -> list:
        """torch.distributed's object collectives unpickle what peers send through ``_unpickler``."""
        import torch.distributed.distributed_c10d as c10d

        return [(c10d, "_unpickler")]


class ShardedTable:
    """A registered object holding a DTensor split over the processes by rows (``Shard(0)`` on a
    1-D device mesh of every process)."""

    _meshes: dict = {}  # one mesh per group size: each one is a process group of its own

    def __init__(self, acc: Accelerator, fill: float) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        key = (acc.device.type, acc.num_processes)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(acc.device.type, (acc.num_processes,))
        self.mesh = self._meshes[key]
        rows = torch.full((2, 3), fill + acc.process_index, dtype=torch.float32, device=acc.device)
        self.table = DTensor.from_local(rows, self.mesh, [Shard(0)])
        self.placements = self.table.placements

    def state_dict(self) -> dict:
        return {"table": self.table, "note": "sharded"}

    def load_state_dict(self, state: dict) -> None:
        self.table = state["table"]

    def mine(self) -> list:
        """This process's rows (one shard)."""
        return [self.table.to_local().cpu().tolist()]

    def same_layout(self) -> bool:
        return self.table.placements == self.placements and self.table.device_mesh == self.mesh


class TorchKit(Kit):
    training = TorchTraining
    loop = TorchSetup
    sharded = TorchShardedSetup
    sharded_table = ShardedTable
