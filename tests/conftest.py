from unified.backend.registry import available_backends

# Every registered backend whose framework is installed: the built-in ones, and any registered
# through the `unified.backends` entry-point group. (The conformance suite in unified/testing is
# parametrized by its pytest plugin instead, which also honours --unified-backend.)
BACKENDS = available_backends()


def _share_jax_compilations() -> None:
    """One JAX compilation cache for this test session and every process it starts (the process
    groups compile the same small programs again and again: measured, the sharding module's JAX
    groups took 74 s instead of 89 s with it). A cache the caller set is kept."""
    import atexit
    import os
    import shutil
    import tempfile

    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="unified-jax-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": folder, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})


_share_jax_compilations()
