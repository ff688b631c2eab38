"""A save starts every array's device-to-host copy before it waits for the first (issue 48: a JAX
async save blocked for one transfer after another on a GPU). Checked on the order of the calls
through the backend boundary; on the CPU a JAX array is already host memory and nothing starts."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")


def test_a_save_begins_every_arrays_host_copy_before_exporting_any(tmp_path, monkeypatch):
    from backends.jax.core import JaxBackend
    from unified import Accelerator

    events = []
    begin, export = JaxBackend.begin_host_copies, JaxBackend.export_array

    def begin_host_copies(self, values):
        events.append(("begin", len(values)))
        return begin(self, values)

    def export_array(self, value):
        events.append(("export", None))
        return export(self, value)

    monkeypatch.setattr(JaxBackend, "begin_host_copies", begin_host_copies)
    monkeypatch.setattr(JaxBackend, "export_array", export_array)
    acc = Accelerator(backend="jax")
    acc.prepare(nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1))))
    acc.save_state(str(tmp_path / "ckpt"))
    assert events[0] == ("begin", 4), events  # the model's four arrays, before the first export
    assert [kind for kind, _ in events[1:5]] == ["export"] * 4, events
    acc.end_training()
