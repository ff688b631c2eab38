"""Loads in bounded memory on JAX (issue 29): JAX arrays cannot be written in place, so a load
verifies every file first, then replaces the large arrays of the prepared objects one at a time
(`TrainingObjects.replaceable_arrays`), each made from a staging buffer that the next one
reuses: the peak is the live state plus about one array and the buffer, not a second copy of
the state. The arrays replaced are not written: a reference the script kept keeps its values.

Before this change a JAX load read every file into fresh memory and then made new arrays of
all of them: a fresh process's peak held the state twice."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from unified.errors import CheckpointError

from .changed_files import change_after_verification

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")


def _run(width=1024):
    from unified import Accelerator

    acc = Accelerator(backend="jax")
    model = nnx.Sequential(nnx.Linear(width, width, rngs=nnx.Rngs(0)), nnx.Linear(width, 8, rngs=nnx.Rngs(1)))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    model, optimizer = acc.prepare(model, optimizer)
    return acc, model, optimizer


def _step(model, optimizer, scale=1.0):
    grads = nnx.grad(lambda m: (m(jax.numpy.ones((2, m.layers[0].in_features)) * scale) ** 2).mean())(model)
    optimizer.update(model, grads)


def _snapshot(*objects):
    return [jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(o))) for o in objects]


def _equal(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_load_replaces_the_large_arrays_exactly_and_writes_none_in_place(tmp_path):
    acc, model, optimizer = _run()
    _step(model, optimizer)
    saved = _snapshot(model, optimizer)
    acc.save_state(str(tmp_path / "ckpt"))
    _step(model, optimizer, scale=3.0)
    kept = model.layers[0].kernel.get_value()  # a reference the script holds (an EMA, a comparison)
    kept_values = np.array(kept)
    acc.load_state(str(tmp_path / "ckpt"))
    assert all(_equal(a, b) for a, b in zip(_snapshot(model, optimizer), saved))
    assert model.layers[0].kernel.get_value() is not kept  # the 4 MiB kernel was replaced...
    assert np.array_equal(np.asarray(kept), kept_values)  # ...and the array the script kept is unchanged
    assert model.layers[0].kernel.get_value().sharding == kept.sharding
    _step(model, optimizer)  # trains on
    acc.end_training()



def test_the_overlapped_hand_off_a_gpu_takes_restores_exactly(tmp_path, monkeypatch):
    """On a GPU a replaced array's transfer runs while the next one is read (`_Slot.replace_async`,
    two staging buffers taking turns). No GPU here: the same path is forced on the CPU, and must
    restore every value exactly, leave the arrays the script kept unchanged and train on. (The
    rotation's waits are checked with copies that run late in test_overlapped_placing.py.)"""
    from backends.jax.core import _Slot

    calls = []
    replace_async = _Slot.replace_async

    def recorded(self, host):
        calls.append(host.nbytes)
        return replace_async(self, host)

    monkeypatch.setattr(_Slot, "keeps_host", property(lambda self: False))  # as on a GPU
    monkeypatch.setattr(_Slot, "copies_while_reading", property(lambda self: True))
    monkeypatch.setattr(_Slot, "replace_async", recorded)
    acc, model, optimizer = _run()
    _step(model, optimizer)
    saved = _snapshot(model, optimizer)
    acc.save_state(str(tmp_path / "ckpt"))
    _step(model, optimizer, scale=3.0)
    kept = jax.tree.leaves(nnx.state(model))  # references the script holds: every array is replaced
    kept_values = [np.array(k) for k in kept]
    acc.load_state(str(tmp_path / "ckpt"))
    assert calls and max(calls) >= 4 << 20  # the 4 MiB kernel went through it
    assert all(_equal(a, b) for a, b in zip(_snapshot(model, optimizer), saved))
    assert all(np.array_equal(np.asarray(k), v) for k, v in zip(kept, kept_values))
    _step(model, optimizer)
    acc.end_training()


def test_a_file_changed_while_arrays_are_replaced_is_reported_as_partly_restored(tmp_path, monkeypatch):
    acc, model, optimizer = _run()
    acc.save_state(str(tmp_path / "ckpt"))
    change_after_verification(monkeypatch, "model_0.safetensors", seen=False)  # as if it changed mid-read
    with pytest.raises(CheckpointError, match="changed while it was read into the live objects") as caught:
        acc.load_state(str(tmp_path / "ckpt"), verify_first=True)
    assert "model_0.safetensors" in str(caught.value) and "#changed-while-placed" in str(caught.value)
    acc.end_training()


_PEAK = textwrap.dedent("""
    import json, sys
    from flax import nnx
    from unified import Accelerator

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    acc = Accelerator(backend="jax")
    model = acc.prepare(nnx.Sequential(*[nnx.Linear(2048, 2048, rngs=nnx.Rngs(i)) for i in range(24)]))  # 384 MiB
    if sys.argv[2] == "save":
        acc.save_state(sys.argv[1])
    else:
        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts again from VmRSS: the peak of the load alone
        acc.load_state(sys.argv[1])
        print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS")}))
""")


def test_a_fresh_process_resumes_without_a_second_copy_of_the_state(tmp_path):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the peak of one call needs a writable /proc/self/clear_refs (Linux)")
    script = tmp_path / "peak.py"
    script.write_text(_PEAK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), "save"], check=True, env=env, timeout=300)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), "load"], check=True, env=env,
                         timeout=300, capture_output=True, text=True).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    state = 24 * (2048 * 2048 + 2048) * 4
    # before: the state's 384 MiB a second time; now well below 100 MiB whatever the state's size
    # on the CPU: the arrays read ahead (64 MiB) and up to 64 MiB of replaced arrays not handed back yet
    assert measured["peak"] - measured["before"] < state // 2, measured


def test_a_replacement_that_fails_midway_is_reported_on_every_process_as_partly_restored(tmp_path, monkeypatch):
    from backends.jax import core

    acc, model, optimizer = _run()
    acc.save_state(str(tmp_path / "ckpt"))
    replace, calls = core._Slot.replace, []

    def out_of_memory_on_the_second(self, host):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate")
        replace(self, host)

    monkeypatch.setattr(core._Slot, "replace", out_of_memory_on_the_second)
    monkeypatch.setattr(core._Slot, "writable_in_place", lambda self: None)  # every array replaced
    with pytest.raises(CheckpointError, match="failed after it was verified") as caught:
        acc.load_state(str(tmp_path / "ckpt"))
    assert "RESOURCE_EXHAUSTED" in str(caught.value) and "#placing-failed" in str(caught.value)
    monkeypatch.setattr(core._Slot, "replace", replace)
    acc.load_state(str(tmp_path / "ckpt"))  # loading again is the way out
    acc.end_training()


def test_a_cpu_array_is_made_over_the_memory_the_load_read_it_into():
    """On the CPU the new array of a replacement is the load's own memory (`KeepsHost`), not a
    copy of a staging buffer: before, every array was read, then copied once more (0.5 GB of
    extra copies and 64 MiB more at the peak for a 1.5 GB state)."""
    from backends.jax.core import _Slot
    from unified.checkpoint import safetensors_io

    variable = nnx.Param(jax.numpy.zeros((256, 256), jax.numpy.float32))
    slot = _Slot(variable)
    assert slot.keeps_host
    host = safetensors_io.private_array(np.dtype(np.float32), (256, 256))
    host[...] = 3.0
    slot.replace(host)
    assert variable.get_value().unsafe_buffer_pointer() == host.ctypes.data
    assert float(variable.get_value()[5, 7]) == 3.0 and variable.get_value().dtype == jax.numpy.float32


def _pointers(*objects):
    return [leaf.unsafe_buffer_pointer() for o in objects for leaf in jax.tree.leaves(nnx.to_pure_dict(nnx.state(o)))
            if leaf.nbytes >= 1 << 20]


def test_a_cpu_load_writes_the_arrays_only_their_variables_hold_in_place(tmp_path):
    """On the CPU an array that only its Variable holds is handed to a new array of the same
    memory (XLA's donation) and the checkpoint read straight into it: no new memory, no second
    copy (a resume in a fresh process replaced every array, 1.5 GB of new memory)."""
    acc, model, optimizer = _run()
    _step(model, optimizer)
    saved = _snapshot(model, optimizer)
    acc.save_state(str(tmp_path / "ckpt"))
    _step(model, optimizer, scale=3.0)
    before = _pointers(model, optimizer)
    acc.load_state(str(tmp_path / "ckpt"))
    assert all(_equal(a, b) for a, b in zip(_snapshot(model, optimizer), saved))
    assert _pointers(model, optimizer) == before and len(before) == 3  # the kernel and its two moments
    _step(model, optimizer)  # trains on
    acc.end_training()


def test_a_freshly_prepared_model_is_written_in_place_too(tmp_path):
    """`prepare` leaves the arrays XLA's own (before, a prepared array was made over a NumPy view
    of the one it replaced, which XLA may not hand over: a resume copied every array)."""
    acc, model, optimizer = _run()
    acc.save_state(str(tmp_path / "ckpt"))
    acc2, model2, optimizer2 = _run()
    before = _pointers(model2, optimizer2)
    acc2.load_state(str(tmp_path / "ckpt"))
    assert _pointers(model2, optimizer2) == before
    assert all(_equal(a, b) for a, b in zip(_snapshot(model2, optimizer2), _snapshot(model, optimizer)))
    acc.end_training()


@pytest.mark.parametrize("kept_as", ["a second array over the same memory", "a NumPy view"])
def test_memory_something_else_sees_is_never_written(tmp_path, kept_as):
    """An array whose memory another array or a NumPy view shares is replaced, not written: what
    the script kept keeps its values and stays usable."""
    acc, model, optimizer = _run()
    _step(model, optimizer)
    saved = _snapshot(model, optimizer)
    acc.save_state(str(tmp_path / "ckpt"))
    _step(model, optimizer, scale=3.0)
    kernel = model.layers[0].kernel.get_value()
    if kept_as == "a NumPy view":
        kept = np.asarray(kernel)
    else:
        kept = jax.device_put(kernel, next(iter(kernel.sharding.device_set)))
        assert kept is not kernel and kept.unsafe_buffer_pointer() == kernel.unsafe_buffer_pointer()
    del kernel
    kept_values = np.array(kept)
    acc.load_state(str(tmp_path / "ckpt"))
    assert all(_equal(a, b) for a, b in zip(_snapshot(model, optimizer), saved))
    assert np.array_equal(np.asarray(kept), kept_values)  # neither deleted nor overwritten
    acc.end_training()
