"""The JAX backend (jax.distributed, Flax NNX, Orbax). This module is imported to read `SPEC` and
imports no framework; the backend itself is `backends.jax.core.JaxBackend`."""
from unified.backend.registry import BackendSpec

SPEC = BackendSpec(
    name="jax",
    backend="backends.jax.core:JaxBackend",
    framework="jax",
    install="pip install 'unified[jax]'",
    launcher="backends.jax.launch:LAUNCHER",
    report="backends.jax.env:report",
    distributions=("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"),
    # The oldest versions are the floors in pyproject.toml, installed by .ci/run's floor job
    # (.ci/floors.txt); the newest are what the main CI job installed when last updated.
    tested_versions=(("jax", "0.8.2", "0.10.2"), ("jaxlib", "0.8.2", "0.10.2"), ("flax", "0.12.2", "0.12.8"),
                     ("optax", "0.2.0", "0.2.8"), ("orbax-checkpoint", "0.11.17", "0.12.8")),
    private_apis="backends.jax.private:check",
    testing_kit="backends.jax.testing:JaxKit",
)
