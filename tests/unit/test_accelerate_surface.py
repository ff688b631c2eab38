"""Accelerate 1.15's smaller public names on `Accelerator` (issue 24), on the in-memory backend:
``state`` prints as Accelerate's, `DistributedType` has Accelerate's members, the
process-selecting decorators, ``prepare(None)``, ``free_memory`` and ``save``."""
from __future__ import annotations

import numpy as np
import pytest

from unified import DistributedType, ProjectConfiguration

from .memory_backend import MemoryGroup, run_accelerators, unwrap

# Accelerate 1.15's members, in its order (accelerate.utils.DistributedType)
ACCELERATE_MEMBERS = ["NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                      "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"]


def test_distributed_type_has_every_member_of_accelerate():
    names = [m.name for m in DistributedType]
    assert set(ACCELERATE_MEMBERS) <= set(names)
    assert DistributedType.XLA == "XLA" and DistributedType["DEEPSPEED"] is DistributedType.DEEPSPEED


def test_state_prints_as_accelerate_does_on_one_process():
    acc = MemoryGroup(1).accelerator(0)
    assert str(acc.state) == ("Distributed environment: DistributedType.NO\nNum processes: 1\nProcess index: 0\n"
                              "Local process index: 0\nDevice: cpu\n\nMixed precision type: no\n")
    assert acc.state.backend is None and not acc.state.use_distributed and acc.state.deepspeed_plugin is None


def test_state_and_process_decorators_in_a_group():
    def body(acc):
        acc._backend.communication_backend = "memory"

        @acc.on_process(process_index=1)
        def second():
            return "second"

        @acc.on_local_process(local_process_index=0)
        def first_of_machine():
            return "local 0"

        @acc.on_last_process
        def last():
            return "last"

        return repr(acc.state), second(), first_of_machine(), last(), acc.use_distributed

    _, results = run_accelerators(3, body, local_num_processes=3)
    for rank, (state, second, local, last, distributed) in enumerate(unwrap(results)):
        assert state.startswith(f"Distributed environment: DistributedType.MULTI_CPU  Backend: memory\n"
                                f"Num processes: 3\nProcess index: {rank}\nLocal process index: {rank}\n")
        assert second == ("second" if rank == 1 else None)
        assert local == ("local 0" if rank == 0 else None)
        assert last == ("last" if rank == 2 else None)
        assert distributed


def test_on_process_needs_an_index():
    acc = MemoryGroup(1).accelerator(0)
    with pytest.raises(TypeError, match="process_index="):
        acc.on_process(lambda: None)


def test_prepare_passes_none_through():
    acc = MemoryGroup(1).accelerator(0)
    assert acc.prepare(None) is None


class _Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_free_memory_forgets_prepared_objects_but_keeps_registered_ones(tmp_path):
    from unified import DataLoader

    acc = MemoryGroup(1).accelerator(
        0, project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    loader = acc.prepare(DataLoader(np.arange(8, dtype=np.float32), batch_size=2))
    counter = _Counter()
    acc.register_for_checkpointing(counter)
    assert acc.free_memory(loader) == [None]
    assert [e.name for e in acc._checkpoints.entries] == ["custom_checkpoint_0"]
    again = acc.prepare(DataLoader(np.arange(4, dtype=np.float32), batch_size=2))
    assert [e.name for e in acc._checkpoints.entries] == ["custom_checkpoint_0", "dataloader_0"]
    assert again is not None and acc.clear() == []


def test_save_writes_safetensors_on_the_main_process_only(tmp_path):
    def body(acc):
        acc.save({"w": np.arange(3, dtype=np.float32)}, str(tmp_path / "w.safetensors"), safe_serialization=True)
        return None

    run_accelerators(2, body)
    path = tmp_path / "w.safetensors"
    from safetensors.numpy import load_file

    assert load_file(str(path))["w"].tolist() == [0.0, 1.0, 2.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no temporary left


def test_save_without_safe_serialization_needs_a_format_of_the_backend(tmp_path):
    acc = MemoryGroup(1).accelerator(0)
    with pytest.raises(TypeError, match="safe_serialization=True"):
        acc.save({"w": np.zeros(1)}, str(tmp_path / "w.bin"))
    with pytest.raises(TypeError, match="dict of arrays"):
        acc.save([1, 2], str(tmp_path / "w.safetensors"), safe_serialization=True)
    assert list(tmp_path.iterdir()) == []


def test_dataloader_configuration_defaults_views_and_refusals():
    from unified import DataLoader, DataLoaderConfiguration

    acc = MemoryGroup(1).accelerator(0)
    assert acc.dataloader_config == DataLoaderConfiguration()
    assert (acc.split_batches, acc.dispatch_batches, acc.even_batches) == (False, None, True)
    config = DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=True, non_blocking=True,
                                     data_seed=7)
    acc = MemoryGroup(1).accelerator(0, dataloader_config=config)
    assert acc.use_seedable_sampler and acc.use_stateful_dataloader and acc.non_blocking
    first = [b.tolist() for b in acc.prepare(DataLoader(np.arange(8.0), batch_size=2, shuffle=True))]
    same = [b.tolist() for b in MemoryGroup(1).accelerator(0, seed=7).prepare(
        DataLoader(np.arange(8.0), batch_size=2, shuffle=True))]
    assert first == same  # data_seed seeds the loaders' order as seed= would
    with pytest.raises(NotImplementedError, match="split_batches="):  # dispatch_batches=True: see below
        MemoryGroup(1).accelerator(0, dataloader_config=DataLoaderConfiguration(split_batches=True))
    # even_batches=False: as Accelerate's (tests/unit/test_accelerate_suite_gaps.py)
    assert MemoryGroup(1).accelerator(0, dataloader_config=DataLoaderConfiguration(even_batches=False)).even_batches \
        is False
    # Accelerate's dispatcher (tests/unit/test_dispatch_batches.py), which does not read even_batches
    config = DataLoaderConfiguration(dispatch_batches=True, even_batches=False)
    assert MemoryGroup(1).accelerator(0, dataloader_config=config).dispatch_batches is True


def test_prepared_lists_marks_and_preparing_twice():
    from unified import DataLoader

    acc = MemoryGroup(1).accelerator(0)
    loader = acc.prepare(DataLoader(np.arange(4.0), batch_size=2))
    assert acc.prepare(loader) is loader and acc._dataloaders == [loader]  # tracked once
    assert loader._is_accelerate_prepared is True
    assert [e.name for e in acc._checkpoints.entries] == ["dataloader_0"]
    assert acc.prepare_data_loader(loader) is loader
    assert acc._models == [] and acc._optimizers == [] and acc._schedulers == []
    with pytest.raises(NotImplementedError, match="device_placement"):
        acc.prepare(loader, device_placement=False)


def test_sync_gradients_is_settable():
    acc = MemoryGroup(1).accelerator(0)
    acc.sync_gradients = False
    assert acc.gradient_state.sync_gradients is False


def test_split_batches_in_the_constructor_is_ignored_with_a_warning_as_accelerate_ignores_it():
    with pytest.warns(FutureWarning, match="ignored, as Accelerate 1.15 ignores it"):
        acc = MemoryGroup(1).accelerator(0, split_batches=True)
    assert acc.split_batches is False


# Accelerate's values for features unified does not have, as on an Accelerate run not using them
NOT_IN_USE = {"ao_recipe_handler": None, "autocast_handler": None, "ddp_handler": None, "fp8_recipe_handler": None,
              "init_handler": None, "msamp_recipe_handler": None, "profile_handler": None, "scaler_handler": None,
              "te_recipe_handler": None, "deepspeed_plugin": None, "parallelism_config": None,
              "torch_device_mesh": None, "rng_types": None, "flag_tensor": None, "device_placement": True,
              "fp8_enabled": False, "delayed_fp8_autocast": False, "has_fp8_handler": False,
              "has_lomo_optimizer": False, "fp8_backend": "NO", "is_composable_parallelism_enabled": False,
              "is_fsdp2": False, "multi_device": False, "native_amp": False, "scaler": None}


def test_values_of_features_not_in_use():
    acc = MemoryGroup(1).accelerator(0)
    assert {name: getattr(acc, name) for name in NOT_IN_USE} == NOT_IN_USE


def test_counters_flags_and_views():
    acc = MemoryGroup(1).accelerator(0, project_config=ProjectConfiguration(iteration=3), log_with=[])
    assert (acc.save_iteration, acc.step, acc.should_save_model, acc.log_with) == (3, 0, True, [])
    acc.unscale_gradients()  # nothing to unscale without a loss scaler
    assert acc.verify_device_map(object()) is False


class _Dispatched:
    hf_device_map = {"layer.0": "cpu", "layer.1": "disk"}


def test_verify_device_map_sees_a_model_spread_over_devices():
    assert MemoryGroup(1).accelerator(0).verify_device_map(_Dispatched()) is True


def test_what_unified_does_not_have_is_a_clear_error():
    acc = MemoryGroup(1).accelerator(0)
    for name in ("data_parallel_rank", "data_parallel_shard_rank", "tensor_parallel_rank"):
        with pytest.raises(RuntimeError, match="process_index"):
            getattr(acc, name)
    for name in ("pipeline_parallel_rank", "context_parallel_rank"):
        with pytest.raises(NotImplementedError, match="Accelerate, which does not support it either"):
            getattr(acc, name)
    with pytest.raises(NotImplementedError, match="torch.profiler.profile"):
        acc.profile()
    with pytest.raises(NotImplementedError, match="accelerator.backward"):
        acc.lomo_backward(None, 0.1)
    with acc.trigger_sync_in_backward(None):  # no gradients synchronised by a backward here: nothing to do
        pass


def test_context_managers_that_do_nothing_here():
    acc = MemoryGroup(1).accelerator(0)
    with acc.join_uneven_inputs([object()]), acc.maybe_context_parallel():
        pass
    with acc.join_uneven_inputs([], even_batches=False):  # one process: nothing to join, as in Accelerate
        pass
    loader = object()
    assert acc.deepspeed_ulysses_dl_adapter(loader, None) is loader


def test_split_between_processes_in_a_group_of_three():
    def body(acc):
        with acc.split_between_processes(list("abcde")) as letters, \
                acc.split_between_processes({"x": np.arange(5), "y": list("vwxyz")}) as columns, \
                acc.split_between_processes(list("abcd"), apply_padding=True) as padded:
            return letters, columns["x"].tolist(), columns["y"], padded

    _, results = run_accelerators(3, body)
    assert unwrap(results) == [(["a", "b"], [0, 1], ["v", "w"], ["a", "b"]),
                               (["c", "d"], [2, 3], ["x", "y"], ["c", "c"]),
                               (["e"], [4], ["z"], ["d", "d"])]


def test_split_between_processes_refuses_uneven_dict_values():
    def body(acc):
        with acc.split_between_processes({"x": [1, 2], "y": [1]}):
            pass

    _, results = run_accelerators(2, body)
    assert all(isinstance(r, ValueError) and "same length" in str(r) for r in results)


def test_gradient_accumulation_plugin_and_features_not_in_use_in_the_constructor():
    from unified.utils import GradientAccumulationPlugin


    with pytest.raises(ValueError, match="only pass one of"):
        MemoryGroup(1).accelerator(0, gradient_accumulation_steps=2,
                                   gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    with pytest.raises(NotImplementedError, match="sync_each_batch"):
        MemoryGroup(1).accelerator(0, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1,
                                                                                              sync_each_batch=True))
    acc = MemoryGroup(1).accelerator(0, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
                                     deepspeed_plugin=None, dynamo_backend="no", parallelism_config=None)
    assert acc.gradient_accumulation_steps == 1
    with pytest.raises(NotImplementedError, match="fsdp_plugin"):
        MemoryGroup(1).accelerator(0, deepspeed_plugin=object())
    with pytest.raises(NotImplementedError, match="torch.compile"):
        MemoryGroup(1).accelerator(0, dynamo_backend="inductor")
    with pytest.raises(TypeError, match="unexpected keyword argument 'fp16'"):
        MemoryGroup(1).accelerator(0, fp16=True)


def test_kwargs_handlers_are_checked_against_the_backend():
    import datetime

    from unified.compat.kwargs_handlers import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        InitProcessGroupKwargs,
        resolve_handlers,
    )

    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs() == {"find_unused_parameters": True}
    from unified import Accelerator

    acc = Accelerator(backend=MemoryGroup(1).backends[0],
                      kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=42))])
    assert acc._collectives.timeout == 42.0 and acc.init_handler is not None and acc.ddp_handler is None
    with pytest.raises(NotImplementedError, match="means nothing to the 'memory' backend"):
        MemoryGroup(1).accelerator(0, kwargs_handlers=[AutocastKwargs(cache_enabled=False)])
    with pytest.raises(NotImplementedError, match="comm_hook"):
        resolve_handlers([DistributedDataParallelKwargs(comm_hook="fp16")])
    with pytest.raises(NotImplementedError, match="init_method"):
        resolve_handlers([InitProcessGroupKwargs(init_method="tcp://127.0.0.1:1")])
    with pytest.raises(ValueError, match="only pass one"):
        resolve_handlers([InitProcessGroupKwargs(), InitProcessGroupKwargs()])
    with pytest.raises(NotImplementedError, match="ProfileKwargs"):
        resolve_handlers([type("ProfileKwargs", (), {"to_kwargs": lambda self: {}})()])


def test_function_forms_of_the_collectives_act_through_the_live_accelerator():
    from unified import utils

    def body(acc):
        rank = acc.process_index
        gathered = utils.gather_object([rank, f"r{rank}"])
        shared = utils.broadcast_object_list([rank, "x"], from_process=1)
        total = utils.reduce(np.array([float(rank)]), "sum")
        acc.end_training()
        try:
            utils.gather_object([rank])
        except RuntimeError as err:
            after = str(err)
        return gathered, shared, total.tolist(), after

    _, results = run_accelerators(2, body)
    for gathered, shared, total, after in unwrap(results):
        assert gathered == [0, "r0", 1, "r1"] and shared == [1, "x"] and total == [1.0]
        assert "live Accelerator" in after


def test_find_executable_batch_size_retries_smaller_on_out_of_memory():
    from unified.utils import find_executable_batch_size, release_memory

    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 40:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * scale

    assert train(2) == 80 and tried == [64, 57, 51, 45, 40]  # x0.9 each time, as Accelerate
    with pytest.raises(TypeError, match="as the first argument"):
        train(64, 2)

    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()
    assert release_memory(object(), object()) == [None, None]


def test_patch_environment_restores_what_was_there(monkeypatch):
    import os

    from unified.utils import patch_environment

    monkeypatch.setenv("UNIFIED_PROBE", "before")
    with patch_environment(unified_probe=1, unified_new="x"):
        assert os.environ["UNIFIED_PROBE"] == "1" and os.environ["UNIFIED_NEW"] == "x"
    assert os.environ["UNIFIED_PROBE"] == "before" and "UNIFIED_NEW" not in os.environ


def test_multi_device_is_false_for_a_group_on_cpu_whatever_its_distributed_type():
    """A JAX group on CPU devices (distributed_type JAX) is not multi-device, as Accelerate's
    MULTI_CPU is not (found by review: multi_device looked at the type's name only)."""
    def body(acc):
        acc._backend.group_distributed_type = "JAX"
        return acc.multi_device

    _, results = run_accelerators(2, body)
    assert unwrap(results) == [False, False]
