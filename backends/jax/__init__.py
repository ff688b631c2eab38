"""The JAX backend (jax.distributed, Flax NNX, Orbax). This module is imported to read `SPEC` and
imports no framework; the backend itself is `backends.jax.core.JaxBackend`."""
from unified.registry import BackendSpec

SPEC = BackendSpec(
    name="jax",
    backend="backends.jax.core:JaxBackend",
    framework="jax",
    install="pip install 'unified[jax]'",
    launcher="backends.jax.launch:LAUNCHER",
    report="backends.jax.env:report",
    distributions=("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"),
)
