"""`unified.testing`'s declarations, without process groups: a scenario states what it needs, an
unknown need fails when its module is imported, a backend's missing capability or kit slot is
named, and only declared scenarios run in a worker."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import unified.backend.registry as registry
from unified.testing import Kit, scenario
from unified.testing.checkpoint_scenarios import ckpt_async_part_failures, ckpt_sharded
from unified.testing.kit import kit_of
from unified.testing.plugin import _names
from unified.testing.scenario import HEALTH_CHANNEL, backend_features, missing_requirements, reference, requirements
from unified.testing.scenarios import identity


def test_a_scenario_declares_capabilities_kit_slots_and_sizes():
    @scenario(requires=("TrainingLoop", HEALTH_CHANNEL), kit=("loop",), processes=(2, 3))
    def accumulates(state):
        return {}

    needs = requirements(accumulates)
    assert (needs.capabilities == ("TrainingLoop", "HealthChannel") and needs.kit == ("loop",)
            and needs.processes == (2, 3))
    assert reference(accumulates).endswith(
        ":test_a_scenario_declares_capabilities_kit_slots_and_sizes.<locals>.accumulates")
    assert requirements(scenario(lambda state: None)).capabilities == ()


@pytest.mark.parametrize("declaration, message", [
    ({"requires": ("TrainingLoops",)}, "unknown capabilities ['TrainingLoops']"),
    ({"kit": ("looop",)}, "unknown Kit attributes ['looop']"),
])
def test_an_unknown_requirement_fails_where_it_is_declared(declaration, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        scenario(**declaration)


def test_a_plain_function_is_not_a_scenario():
    with pytest.raises(TypeError, match="decorate it with @unified.testing.scenario"):
        requirements(lambda state: None)


@pytest.fixture
def bare_backend(monkeypatch):
    """A registered backend with the core only (the memory backend of the unit tests) and no kit."""
    spec = registry.BackendSpec(name="bare", backend="tests.unit.memory_backend:MemoryBackend", framework="numpy",
                                install="-", launcher="unified.launcher.launch:Launcher")
    monkeypatch.setitem(registry._registry(), "bare", spec)
    backend_features.cache_clear()
    kit_of.cache_clear()
    yield "bare"
    backend_features.cache_clear()
    kit_of.cache_clear()


def test_what_a_backend_lacks_is_named_capability_or_kit_slot(bare_backend):
    have = backend_features(bare_backend)
    assert HEALTH_CHANNEL not in have and "ShardedArrays" not in have
    reasons = missing_requirements(bare_backend, [identity, ckpt_async_part_failures, ckpt_sharded])
    assert set(reasons) == {"ckpt_async_part_failures", "ckpt_sharded"}
    assert "lacks" in reasons["ckpt_async_part_failures"] and "HealthChannel" in reasons["ckpt_async_part_failures"]
    assert "TrainingObjects" in reasons["ckpt_async_part_failures"]
    assert isinstance(kit_of(bare_backend), Kit) and kit_of(bare_backend).training is None


def test_a_capability_without_its_kit_slot_is_named_as_the_kits_gap(bare_backend, monkeypatch):
    scenario_module = sys.modules["unified.testing.scenario"]  # (the package exports the decorator under that name)
    monkeypatch.setattr(scenario_module, "backend_features", lambda name: frozenset({"ShardedArrays"}))
    assert missing_requirements(bare_backend, [ckpt_sharded]) == {
        "ckpt_sharded": "the testing kit of backend 'bare' has no sharded_table (needed by scenario ckpt_sharded)"}


def test_the_plugin_sees_the_scenarios_a_test_reads():
    def a_test(group):
        rows = group.scenario(identity)
        return [r for r in rows if (lambda: ckpt_sharded)()]

    assert {"identity", "ckpt_sharded"} <= set(_names(a_test))


def test_the_worker_runs_only_declared_scenarios(tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "unified.testing.worker", "os.path:join"],
                         capture_output=True, text=True, env={"UNIFIED_TEST_OUT": str(out), "PATH": ""}, timeout=60)
    assert run.returncode != 0 and "is not a conformance scenario" in run.stderr, run.stderr[-2000:]
    assert not out.exists()
    run = subprocess.run([sys.executable, "-m", "unified.testing.worker", "unified.testing.scenarios:identity"],
                         capture_output=True, text=True, env={"UNIFIED_TEST_OUT": str(out), "PATH": ""}, timeout=60)
    # identity needs the Accelerator that `start` makes: an unexpected error, reported by name
    assert json.loads(out.read_text())["identity"]["unexpected"] is True
