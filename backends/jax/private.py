"""Every private JAX API the JAX backend relies on, each behind one small function.

JAX has no public way to do these things (see docs/adding-a-backend.md, "Private framework
APIs"), so each one may change in any JAX release. Each function here looks up what it needs
and, when JAX moved it, raises `BackendUnavailable` saying which JAX version changed what,
instead of an ``AttributeError`` far from the cause. `check()` probes every one of them without
starting anything; tests/unit/test_private_apis.py runs it on every CI environment.

- ``jax._src.distributed.global_state``: the process's coordination client (barriers with a
  deadline, the key-value store) and service, which JAX only exposes privately.
- ``jax._src.distributed._jax.get_distributed_runtime_service``: replaced during
  ``jax.distributed.initialize`` so that process 0 joins the launcher's coordination service
  instead of hosting one whose death would abort everyone.
- ``jax._src.lib._jax.get_distributed_runtime_service``: the launcher hosts that service.
- ``jax._src.clusters.ClusterEnv._cluster_types``: whether JAX's own cluster detection (SLURM,
  Open MPI, ...) would find a group.
- the ``jax_enable_recoverability`` and ``jax_enable_preemption_service`` options.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, List, Optional, Tuple

import jax

from unified.errors import BackendUnavailable, see

# The client methods the backend calls (backends/jax/control.py, core.py).
CLIENT_METHODS = ("wait_at_barrier", "key_value_set", "key_value_set_bytes", "key_value_dir_get",
                  "key_value_delete", "blocking_key_value_get_bytes", "get_live_nodes")
CONFIG_OPTIONS = ("jax_enable_recoverability", "jax_enable_preemption_service")


def changed(what: str, detail: str) -> BackendUnavailable:
    """The error for a private API that this JAX version no longer has in the expected form."""
    return BackendUnavailable(
        f"jax {jax.__version__} changed {what}: {detail}. unified relies on this private JAX API; "
        "install a tested jax version (`unified env` shows the tested range) or report it." + see("private-api-changed")
    )


def _distributed_module() -> Any:
    try:
        from jax._src import distributed
    except ImportError as err:
        raise changed("the coordination client", f"jax._src.distributed cannot be imported ({err})") from err
    return distributed


def distributed_state() -> Any:
    """JAX's process-wide distributed state (``client``, ``service``, ``preemption_sync_manager``)."""
    state = getattr(_distributed_module(), "global_state", None)
    if state is None or not all(hasattr(state, name) for name in ("client", "service")):
        raise changed("the coordination client", "jax._src.distributed.global_state has no client/service")
    return state


def coordination_client() -> Any:
    """The coordination client of this process (None before ``jax.distributed.initialize``)."""
    return distributed_state().client


def _lib_jax(what: str) -> Any:
    """``jax._src.lib._jax`` (JAX's compiled extension), or the error naming ``what`` needs it."""
    try:
        from jax._src.lib import _jax
    except ImportError as err:
        raise changed(what, f"jax._src.lib._jax cannot be imported ({err})") from err
    return _jax


def _client_class() -> Any:
    cls = getattr(_lib_jax("the coordination client"), "DistributedRuntimeClient", None)
    if cls is None:
        raise changed("the coordination client", "jax._src.lib._jax.DistributedRuntimeClient is gone")
    return cls


def _check_client() -> None:
    missing = [name for name in CLIENT_METHODS if not hasattr(_client_class(), name)]
    if missing:
        raise changed("the coordination client", f"DistributedRuntimeClient has no {', '.join(missing)}")


def detach_runtime(keep_alive: Any) -> None:
    """Drop JAX's handles to the client and service without their shutdown RPCs; ``keep_alive``
    keeps each dropped handle referenced so that no destructor runs them at exit either."""
    state = distributed_state()
    for name in ("preemption_sync_manager", "client", "service"):
        keep_alive(getattr(state, name, None))
        setattr(state, name, None)


@contextlib.contextmanager
def no_service_here(active: bool) -> Iterator[None]:
    """While ``active``, make ``jax.distributed.initialize`` on process 0 join an existing
    coordination service instead of starting its own."""
    if not active:
        yield
        return
    holder = _service_factory_holder()
    original = holder.get_distributed_runtime_service
    holder.get_distributed_runtime_service = lambda *args, **kwargs: None
    try:
        yield
    finally:
        holder.get_distributed_runtime_service = original


def _gloo_factory_holder() -> Any:
    from jax._src import xla_bridge

    if not callable(getattr(getattr(xla_bridge, "_jax", None), "make_gloo_tcp_collectives", None)):
        raise changed("the CPU collectives", "jax._src.xla_bridge._jax.make_gloo_tcp_collectives is missing")
    return xla_bridge


@contextlib.contextmanager
def gloo_bound_to(address: Optional[str]) -> Iterator[None]:
    """While the CPU client is made, give JAX's gloo collectives ``address`` to bind and announce.

    Without it gloo takes the address the host name resolves to, a loopback address on many
    machines, which no other machine can reach (see unified/runtime/network.py)."""
    if address is None:
        yield
        return
    xla_bridge = _gloo_factory_holder()
    original = xla_bridge._jax.make_gloo_tcp_collectives
    xla_bridge._jax.make_gloo_tcp_collectives = lambda *args, **kwargs: original(
        *args, **{**kwargs, "hostname": kwargs.get("hostname") or address})
    try:
        yield
    finally:
        xla_bridge._jax.make_gloo_tcp_collectives = original


def _service_factory_holder() -> Any:
    holder = getattr(_distributed_module(), "_jax", None)
    if holder is None or not callable(getattr(holder, "get_distributed_runtime_service", None)):
        raise changed("how jax.distributed.initialize starts its coordination service",
                      "jax._src.distributed._jax.get_distributed_runtime_service is gone")
    return holder


def start_service(address: str, num_processes: int, heartbeat_timeout: int, shutdown_timeout: int) -> Any:
    """Host a recoverable coordination service for ``num_processes`` processes on ``address``."""
    factory = getattr(_lib_jax("the coordination service"), "get_distributed_runtime_service", None)
    if factory is None:
        raise changed("the coordination service", "jax._src.lib._jax.get_distributed_runtime_service is gone")
    options = dict(heartbeat_timeout=heartbeat_timeout, shutdown_timeout=shutdown_timeout)
    if "recoverable" in (factory.__doc__ or ""):  # jaxlib >= 0.9: a dead process fails only its own calls
        options["recoverable"] = True
    return factory(address, num_processes, **options)


def _cluster_types() -> List[Any]:
    try:
        from jax._src import clusters
    except ImportError as err:
        raise changed("cluster detection", f"jax._src.clusters cannot be imported ({err})") from err
    types = getattr(getattr(clusters, "ClusterEnv", None), "_cluster_types", None)
    if not isinstance(types, (list, tuple)) or not all(hasattr(t, "is_env_present") for t in types):
        raise changed("cluster detection", "jax._src.clusters.ClusterEnv._cluster_types is gone or holds "
                      "classes without is_env_present")
    return list(types)


def cluster_detected() -> bool:
    """True when JAX's own cluster auto-detection (SLURM, Open MPI, ...) would find a group.
    When JAX changed its cluster registry this warns with the reason and answers False."""
    try:
        types = _cluster_types()
    except BackendUnavailable as err:
        warnings.warn(f"{err} Assuming no cluster: pass the group through `unified launch`.", RuntimeWarning,
                      stacklevel=2)
        return False
    # Opt-in types (mpi4py: "installed" is enough to be present) are never auto-detected by JAX.
    return any(env.is_env_present() for env in types
               if env.__name__ not in ("GkeTpuCluster", "GceTpuCluster")
               and not getattr(env, "opt_in_only_method", False))


def configure_recoverable_group() -> None:
    """Before joining: a dead peer gives survivors an exception instead of aborting them, and
    SIGTERM ends the process (the launcher's stop signal) instead of being logged by JAX."""
    _check_options()
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_enable_preemption_service", False)


def _check_options() -> None:
    known = getattr(jax.config, "values", {})
    missing = [name for name in CONFIG_OPTIONS if name not in known]
    if missing:
        raise changed("its configuration options", f"{', '.join(missing)} is not an option")


def check() -> List[Tuple[str, str]]:
    """Probe every private API above without starting anything; raise the first change found.
    Returns the (name, purpose) rows that were checked."""
    distributed_state()
    _check_client()
    _service_factory_holder()
    _check_options()
    _cluster_types()
    _gloo_factory_holder()
    return [
        ("jax._src.distributed.global_state", "the coordination client: barriers with deadlines, key-value store"),
        ("jax._src.distributed._jax.get_distributed_runtime_service", "process 0 joins the launcher's service"),
        ("jax._src.lib._jax.get_distributed_runtime_service", "the launcher hosts the coordination service"),
        ("jax._src.clusters.ClusterEnv._cluster_types", "JAX's own cluster detection"),
        ("jax._src.xla_bridge._jax.make_gloo_tcp_collectives", "gloo binds the address that reaches the main machine"),
    ]
