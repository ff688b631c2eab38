"""The private framework APIs each backend uses still exist in the installed framework versions.

Every private API sits behind one adapter module (backends/<name>/private.py, listed in
docs/adding-a-backend.md). Its `check()` probes all of them; when a framework release changes
one, the first test here fails with "jax X.Y changed the coordination client: ..." instead of a
distant AttributeError inside a process group. The other tests fake such a change and check
that message, so that the adapter cannot fail silently.
"""
from __future__ import annotations

import importlib.util
import re

import pytest

from unified.backend.registry import available_backends, backend_spec, load_object
from unified.errors import BackendUnavailable

PROBED = [name for name in available_backends() if backend_spec(name).private_apis]
needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


@pytest.mark.parametrize("backend", PROBED)
def test_every_private_api_a_backend_uses_is_there(backend):
    rows, problem = [], ""
    try:
        rows = load_object(backend_spec(backend).private_apis)()
    except BackendUnavailable as err:
        problem = str(err)
    if problem:  # outside the except: the message alone, no chained traceback
        pytest.fail(problem, pytrace=False)
    assert rows and all(name and why for name, why in rows)


def _assert_clear(err: BackendUnavailable, framework: str, what: str) -> None:
    message = str(err)
    assert re.match(rf"{framework} \S+ changed {what}: ", message), message
    assert "#private-api-changed" in message, message


@needs_jax
def test_a_changed_coordination_client_is_named(monkeypatch):
    from jax._src.lib import _jax

    from backends.jax import private

    class Client:  # the methods we call are gone
        def wait_at_barrier(self): ...

    monkeypatch.setattr(_jax, "DistributedRuntimeClient", Client)
    with pytest.raises(BackendUnavailable) as caught:
        private.check()
    _assert_clear(caught.value, "jax", "the coordination client")
    assert "key_value_set" in str(caught.value)


@needs_jax
def test_a_changed_service_factory_is_named(monkeypatch):
    from jax._src import distributed

    from backends.jax import private

    monkeypatch.delattr(distributed, "_jax")
    with pytest.raises(BackendUnavailable) as caught:
        with private.no_service_here(True):
            pass
    _assert_clear(caught.value, "jax", "how jax.distributed.initialize starts its coordination service")


@needs_jax
def test_a_changed_cluster_registry_is_named_and_detection_says_no_cluster(monkeypatch):
    from jax._src import clusters

    from backends.jax import private

    monkeypatch.delattr(clusters.ClusterEnv, "_cluster_types")
    with pytest.raises(BackendUnavailable) as caught:
        private.check()
    _assert_clear(caught.value, "jax", "cluster detection")
    with pytest.warns(RuntimeWarning, match=r"jax \S+ changed cluster detection"):
        assert private.cluster_detected() is False


@needs_jax
def test_a_missing_configuration_option_is_named(monkeypatch):
    import jax

    from backends.jax import private

    before = jax.config.values["jax_enable_recoverability"]
    monkeypatch.setattr(private, "CONFIG_OPTIONS", ("jax_enable_recoverability", "jax_option_from_the_future"))
    with pytest.raises(BackendUnavailable) as caught:
        private.configure_recoverable_group()
    _assert_clear(caught.value, "jax", "its configuration options")
    assert "jax_option_from_the_future" in str(caught.value)
    assert jax.config.values["jax_enable_recoverability"] == before  # nothing was switched half-way


@needs_torch
def test_changed_torch_attributes_are_named():
    from backends.torch import private

    class Sampler:
        replacement = False

    class Scheduler:
        pass

    for call, what in ((lambda: private.draws_one_permutation(Sampler()), "RandomSampler"),
                       (lambda: private.scheduler_step_count(Scheduler()), "LR schedulers"),
                       (lambda: private.tensor_version(object()), "the tensor version counter")):
        with pytest.raises(BackendUnavailable) as caught:
            call()
        _assert_clear(caught.value, "torch", what)


@needs_torch
def test_torch_compile_wraps_the_module_as_orig_mod():
    import torch

    from backends.torch import private

    module = torch.nn.Linear(1, 1)
    assert private.compiled_inner(torch.compile(module)) is module  # wrapping compiles nothing yet
    assert private.compiled_inner(module) is None
