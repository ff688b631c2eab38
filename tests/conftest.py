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


# XLA's CPU compiler at its cheapest settings, appended to any XLA_FLAGS the caller set (a flag the
# caller set is kept): the tests run tiny programs that XLA compiles again in every process, and at
# the default optimization level compiling is most of a JAX process's time (a train step of three
# NNX layers: 4.3 s of CPU to compile and run 3 steps, 1.8 s with these; the sharding module's JAX
# groups 177 -> 143 s of CPU with the cache above). What the tests compare is computed under the
# same flags everywhere (every process a test starts inherits them); the benchmarks, which pytest does
# not run, keep XLA's defaults.
FAST_COMPILE_FLAGS = {"--xla_backend_optimization_level": "0", "--xla_llvm_disable_expensive_passes": "true"}


def _compile_quickly() -> None:
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    added = [f"{name}={value}" for name, value in FAST_COMPILE_FLAGS.items() if name not in flags]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [flags, *added]))


_compile_quickly()
