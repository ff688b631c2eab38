"""A third `unified` backend, shipped the way a package from outside would ship one.

It lives in ``tests/plugin``, installable as its own distribution (``pip install tests/plugin``,
see its ``pyproject.toml``) or, inside this checkout, by putting ``tests/plugin`` on
``PYTHONPATH`` (its ``.dist-info`` folder then registers it). Either way the entry point
``unified.backends: numpy`` registers `SPEC`, with no edit under ``unified/``; its conformance
kit is `unified_numpy_backend.testing.NumpyKit`. Arrays are NumPy arrays; the control plane is a
TCP key-value store (torch's ``TCPStore``, hosted by the launcher as for torch). This module
imports no framework.
"""
from unified.backend.toolkit import BackendSpec

SPEC = BackendSpec(
    name="numpy",
    backend="unified_numpy_backend.core:NumpyBackend",
    framework="numpy",
    install="pip install unified-numpy-backend",
    launcher="unified_numpy_backend.launch:LAUNCHER",
    testing_kit="unified_numpy_backend.testing:NumpyKit",
)
