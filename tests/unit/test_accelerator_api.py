"""The Accelerator's public API on the in-memory backend, configuration, backend choice and host RNG."""
from __future__ import annotations

import json
import pathlib
import random
import time

import numpy as np
import pytest

import unified
import unified.accelerator as accelerator_module
import unified.backend.registry as backend_module
from unified import Accelerator, BackendUnavailable, DistributedType, ProjectConfiguration
from unified.backend.registry import resolve_backend_name
from unified.runtime.rng import capture_host_rng, restore_host_rng, set_seed

from .memory_backend import MemoryGroup, run_accelerators, unwrap


# -- identity ------------------------------------------------------------------------------------------
def test_identity_properties_multi_process():
    def body(acc):
        return dict(
            process_index=acc.process_index, local_process_index=acc.local_process_index,
            num_processes=acc.num_processes, is_main=acc.is_main_process,
            is_local_main=acc.is_local_main_process, is_last=acc.is_last_process,
            backend=acc.backend, device=acc.device, distributed_type=acc.distributed_type,
            repr=repr(acc),
        )

    group, results = run_accelerators(4, body, timeout=7.0, local_num_processes=2)
    for rank, info in enumerate(unwrap(results)):
        assert info["process_index"] == rank
        assert info["local_process_index"] == rank % 2
        assert info["num_processes"] == 4
        assert info["is_main"] is (rank == 0)
        assert info["is_local_main"] is (rank in (0, 2))
        assert info["is_last"] is (rank == 3)
        assert info["backend"] == "memory"
        assert info["device"] == "cpu"
        assert info["distributed_type"] is DistributedType.MULTI_CPU
        assert str(info["distributed_type"]) == "MULTI_CPU"
        assert f"process {rank}/4" in info["repr"] and "'memory'" in info["repr"]
    assert [b.started_with for b in group.backends] == [7.0] * 4


def test_identity_single_process():
    acc = MemoryGroup(1).accelerator(0)
    assert (acc.process_index, acc.local_process_index, acc.num_processes) == (0, 0, 1)
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    assert acc.distributed_type is DistributedType.NO


def test_mesh_needs_the_device_mesh_capability_and_hasattr_stays_false():
    acc = MemoryGroup(1).accelerator(0)
    with pytest.raises(NotImplementedError,
                       match=r"accelerator.mesh needs a backend with DeviceMesh .*'memory' backend"):
        _ = acc.mesh
    assert not hasattr(acc, "mesh")  # a MissingCapability is also an AttributeError
    with pytest.raises(unified.MissingCapability, match="Autograd"):
        acc.backward(None)


def test_mesh_is_jax_only_on_torch(monkeypatch):
    pytest.importorskip("torch")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    acc = Accelerator(backend="torch")
    with pytest.raises(NotImplementedError,
                       match=r"needs a backend with DeviceMesh.*the 'torch' backend does not have it"):
        _ = acc.mesh
    assert not hasattr(acc, "mesh")


def test_mesh_on_jax_is_the_backends_data_mesh(monkeypatch):
    jax = pytest.importorskip("jax")
    from backends.jax.private import cluster_detected

    if cluster_detected():
        pytest.skip("a cluster environment (e.g. SLURM) would make this Accelerator join a group")
    monkeypatch.delenv("UNIFIED_COORDINATOR_ADDRESS", raising=False)
    acc = Accelerator(backend="jax")
    mesh = acc.mesh
    assert isinstance(mesh, jax.sharding.Mesh)
    assert mesh.axis_names == ("data",)
    assert list(mesh.devices.flat) == jax.devices()
    assert acc.mesh is mesh is acc._backend.mesh  # built once, the one prepare and loaders use


def test_project_dir_argument_sets_project_and_logging_dir(tmp_path):
    acc = MemoryGroup(1).accelerator(0, project_dir=tmp_path)
    assert acc.project_dir == str(tmp_path) and isinstance(acc.project_dir, str)
    assert acc.logging_dir == str(tmp_path)
    config = ProjectConfiguration(project_dir="a", logging_dir="logs")
    acc = MemoryGroup(1).accelerator(0, project_config=config)
    assert acc.project_configuration is config
    assert (acc.project_dir, acc.logging_dir) == ("a", "logs")
    assert MemoryGroup(1).accelerator(0).project_dir is None


# -- print and main-only decorators ----------------------------------------------------------------
def test_print_only_on_main_process(capsys):
    def body(acc):
        acc.print("hello from", acc.process_index, sep="|", end="!\n")
        return True

    _, results = run_accelerators(3, body)
    assert unwrap(results) == [True] * 3
    assert capsys.readouterr().out == "hello from|0!\n"


def test_on_main_process_and_on_local_main_process_decorators():
    def body(acc):
        @acc.on_main_process
        def main_only(x, *, y):
            """Main's docstring."""
            return (acc.process_index, x, y)

        @acc.on_local_main_process
        def local_only():
            return acc.process_index

        assert main_only.__name__ == "main_only" and main_only.__doc__ == "Main's docstring."
        return main_only(1, y=2), local_only()

    _, results = run_accelerators(4, body, local_num_processes=2)
    assert unwrap(results) == [((0, 1, 2), 0), (None, None), (None, 2), (None, None)]


# -- single process: everything is a no-op -------------------------------------------------------
def test_single_process_is_a_no_op_and_returns_immediately():
    group = MemoryGroup(1)
    acc = group.accelerator(0, timeout=0.01)
    start = time.monotonic()
    acc.wait_for_everyone()
    acc.wait_for_everyone(timeout=0.001)
    ran = []
    with acc.main_process_first():
        ran.append("main")
    with acc.local_main_process_first():
        ran.append("local")
    assert ran == ["main", "local"]
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False
    np.testing.assert_array_equal(acc.gather(np.array([1, 2])), [1, 2])
    gathered = acc.gather({"s": np.float32(3), "v": 4})
    assert gathered["s"].shape == (1,) and gathered["s"].dtype == np.float32 and gathered["v"].tolist() == [4]
    np.testing.assert_allclose(acc.reduce({"x": np.array([2.0, 4.0])}, "mean")["x"], [2.0, 4.0])
    np.testing.assert_allclose(acc.reduce([np.array(3)], "sum")[0], 3)
    out = acc.broadcast({"w": np.arange(3)})
    np.testing.assert_array_equal(out["w"], np.arange(3))
    assert acc.gather_object({"a": 1}) == [{"a": 1}]
    acc.print("single")
    acc.end_training()
    assert time.monotonic() - start < 1.0
    assert group.calls == [[]], "one process must never reach the backend's collectives"
    assert group.backends[0].shut_down


def test_single_process_body_exception_propagates_unchanged():
    acc = MemoryGroup(1).accelerator(0)
    with pytest.raises(KeyError, match="boom"):
        with acc.main_process_first():
            raise KeyError("boom")
    acc.wait_for_everyone()


def test_end_training_waits_then_shuts_down():
    group, results = run_accelerators(2, lambda acc: acc.end_training())
    unwrap(results)
    assert all(b.shut_down for b in group.backends)
    assert [c[-1] for c in group.calls] == ["end_training #1"] * 2


# -- constructor arguments ------------------------------------------------------------------------
@pytest.fixture
def no_framework_backend(monkeypatch):
    """Make any attempt to build a real backend fail loudly: argument checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a real backend was created before the arguments were checked")

    monkeypatch.setattr(accelerator_module, "create_backend", refuse)


def test_unknown_keyword_raises_type_error(no_framework_backend):
    with pytest.raises(TypeError, match="bogus_kwarg") as info:
        Accelerator(bogus_kwarg=1)
    assert "mixed_precision" in str(info.value)  # lists what is accepted


@pytest.mark.parametrize("name, value", [("mixed_precision", "fp8"), ("mixed_precision", "half"),
                                         ("gradient_accumulation_steps", 0), ("gradient_accumulation_steps", 2.5)])
def test_invalid_training_loop_values_are_refused_before_any_backend(no_framework_backend, name, value):
    with pytest.raises(ValueError, match=name) as info:
        Accelerator(**{name: value})
    assert repr(value) in str(info.value)


def test_mixed_precision_from_the_launcher_variable(no_framework_backend, monkeypatch):
    monkeypatch.setenv("UNIFIED_MIXED_PRECISION", "fp9")
    with pytest.raises(ValueError, match="UNIFIED_MIXED_PRECISION='fp9'"):
        Accelerator()


@pytest.mark.parametrize("kwargs", [{"mixed_precision": "bf16"}, {"gradient_accumulation_steps": 2}])
def test_training_loop_on_a_backend_without_it_is_a_clear_error(kwargs):
    with pytest.raises(unified.MissingCapability, match="TrainingLoop"):
        MemoryGroup(1).accelerator(0, **kwargs)


@pytest.mark.parametrize("name, value", [("even_batches", False), ("dispatch_batches", True)])
def test_unsupported_accelerate_values_raise_not_implemented(no_framework_backend, name, value):
    with pytest.raises(NotImplementedError, match=name) as info:
        Accelerator(**{name: value})
    assert repr(value) in str(info.value)


def test_neutral_accelerate_values_are_accepted():
    acc = MemoryGroup(1).accelerator(0, mixed_precision="no", cpu=True, gradient_accumulation_steps=1,
                                     log_with=None, split_batches=False, even_batches=True)
    assert acc.num_processes == 1


def test_seed_argument_seeds_python_numpy_and_backend():
    group = MemoryGroup(1)
    group.accelerator(0, seed=7)
    got = (random.random(), np.random.rand(), group.backends[0].rng.random())
    random.seed(7)
    np.random.seed(7)
    expected = (random.random(), np.random.rand(), np.random.default_rng(7).random())
    assert got == expected


# -- ProjectConfiguration --------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [0, -1])
def test_project_configuration_rejects_non_positive_total_limit(limit):
    with pytest.raises(ValueError, match=r"total_limit") as info:
        ProjectConfiguration(total_limit=limit)
    assert f"received {limit}" in str(info.value)


def test_project_configuration_defaults_and_paths(tmp_path):
    assert ProjectConfiguration(total_limit=1).total_limit == 1
    config = ProjectConfiguration(project_dir=pathlib.Path(tmp_path))
    assert config.project_dir == str(tmp_path) and config.logging_dir == str(tmp_path)
    config = ProjectConfiguration()
    assert config.project_dir is None and config.logging_dir is None
    config.set_directories(tmp_path / "run")
    assert config.project_dir == str(tmp_path / "run") and config.logging_dir == str(tmp_path / "run")
    assert unified.utils.ProjectConfiguration is ProjectConfiguration


# -- resolve_backend_name ----------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("UNIFIED_BACKEND", raising=False)
    monkeypatch.delenv("UNIFIED_LAUNCHER_BACKEND", raising=False)
    return monkeypatch


def test_resolve_explicit_name_wins(clean_env):
    clean_env.setenv("UNIFIED_BACKEND", "torch")
    clean_env.setenv("UNIFIED_LAUNCHER_BACKEND", "torch")
    assert resolve_backend_name("jax") == "jax"
    assert resolve_backend_name(" JAX ") == "jax"


def test_resolve_from_unified_backend_env(clean_env):
    clean_env.setenv("UNIFIED_BACKEND", "jax")
    clean_env.setenv("UNIFIED_LAUNCHER_BACKEND", "torch")
    assert resolve_backend_name() == "jax"
    clean_env.setenv("UNIFIED_BACKEND", "Torch")
    assert resolve_backend_name(None) == "torch"


def test_resolve_from_launcher_env(clean_env):
    clean_env.setenv("UNIFIED_LAUNCHER_BACKEND", "jax")
    assert resolve_backend_name() == "jax"
    clean_env.setenv("UNIFIED_BACKEND", "")  # empty means unset
    assert resolve_backend_name() == "jax"


@pytest.mark.parametrize("source", ["argument", "UNIFIED_BACKEND", "UNIFIED_LAUNCHER_BACKEND"])
def test_resolve_invalid_name_lists_choices(clean_env, source):
    if source == "argument":
        call = lambda: resolve_backend_name("tensorflow")  # noqa: E731
    else:
        clean_env.setenv(source, "tensorflow")
        call = resolve_backend_name
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "'torch'" in message and "'jax'" in message and "'tensorflow'" in message
    if source != "argument":
        assert source in message


@pytest.mark.parametrize("installed, expected", [
    (["jax"], "jax"), (["torch"], "torch"), (["torch", "jax"], "torch"),
])
def test_resolve_falls_back_to_installed_frameworks(clean_env, installed, expected):
    clean_env.setattr(backend_module, "_installed", lambda module: module in installed)
    assert resolve_backend_name() == expected


def test_resolve_with_nothing_installed_raises_backend_unavailable(clean_env):
    clean_env.setattr(backend_module, "_installed", lambda module: False)
    with pytest.raises(BackendUnavailable, match="pip install"):
        resolve_backend_name()
    assert issubclass(BackendUnavailable, ImportError)


# -- host RNG ----------------------------------------------------------------------------------------
def _draw():
    return ([random.random() for _ in range(3)], random.gauss(0, 1),
            np.random.rand(3).tolist(), np.random.randn(3).tolist())


def test_host_rng_capture_restore_round_trip():
    random.seed(11)
    np.random.seed(11)
    random.gauss(0, 1)      # leave a cached Python gaussian in the state
    np.random.randn(1)      # leave a cached NumPy gaussian in the state
    state = capture_host_rng()
    assert state["numpy"]["has_gauss"] == 1
    first = _draw()
    random.seed(999)
    np.random.seed(999)
    assert _draw() != first
    restore_host_rng(state)
    assert _draw() == first


def test_host_rng_state_survives_json_for_python_part():
    random.seed(5)
    np.random.seed(5)
    state = capture_host_rng()
    state["python"] = json.loads(json.dumps(state["python"]))
    first = _draw()
    _draw()
    restore_host_rng(state)
    assert _draw() == first


def test_set_seed_is_deterministic_and_seeds_the_backend():
    backend = MemoryGroup(1).backends[0]
    set_seed(123, backend=backend)
    first = (_draw(), backend.rng.random())
    set_seed(123, backend=backend)
    assert (_draw(), backend.rng.random()) == first
    set_seed(2**40 + 123)  # larger than NumPy's 32-bit seed range: reduced, not rejected
    set_seed(124)
    assert _draw() != first[0]


def test_memory_backend_rng_state_round_trip():
    backend = MemoryGroup(1).backends[0]
    backend.seed(3)
    backend.rng.random()
    state = backend.rng_state()
    first = backend.rng.random(4).tolist()
    backend.seed(4)
    backend.set_rng_state(state)
    assert backend.rng.random(4).tolist() == first
    with pytest.raises(KeyError):
        backend.set_rng_state({})


def test_register_for_checkpointing_names_offenders_as_accelerate_does():
    """Accelerate's own test (tests/test_state_checkpointing.py::test_invalid_registration)."""

    class Stateful:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    def helper():
        pass

    _, results = run_accelerators(
        1, lambda a: a.register_for_checkpointing(np.zeros(1), np.ones(1), Stateful(), helper))
    err = results[0]
    assert isinstance(err, ValueError) and isinstance(err, TypeError)
    message = str(err)
    assert "Item at index 0, `ndarray`" in message and "Item at index 1" in message
    assert "Item at index 2" not in message
    assert ("Item at index 3, `test_register_for_checkpointing_names_offenders_as_accelerate_does.<locals>.helper`"
            in message)
    assert message.startswith("All `objects` must include a `state_dict` and `load_state_dict` function to be stored. "
                              "The following inputs are invalid:\n\t- Item at index 0, `ndarray`")
    assert "troubleshooting.md#registration-error" in message
