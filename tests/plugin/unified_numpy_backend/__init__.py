"""A third `unified` backend, shipped the way a package from outside would ship one.

It lives in ``tests/plugin`` with a ``.dist-info`` folder whose ``entry_points.txt`` registers
it in the ``unified.backends`` group (and its conformance profile in ``unified.test_profiles``):
putting ``tests/plugin`` on ``PYTHONPATH`` installs it, with no edit under ``unified/`` or
``tests/conformance/``. Arrays are NumPy arrays; the control plane is a TCP key-value store
(torch's ``TCPStore``, hosted by the launcher as for torch). This module imports no framework.
"""
from unified.registry import BackendSpec

SPEC = BackendSpec(
    name="numpy",
    backend="unified_numpy_backend.core:NumpyBackend",
    framework="numpy",
    install="pip install unified-numpy-backend",
    launcher="unified_numpy_backend.launch:LAUNCHER",
)


def _profile():
    from tests.conformance.profiles import Profile

    return Profile("unified_numpy_backend.training:NumpyTraining", "MULTI_CPU", health_channel=False)


PROFILE = _profile()
