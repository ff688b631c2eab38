"""The PyTorch backend. This module is imported to read `SPEC` and imports no framework; the
backend itself is `backends.torch.core.TorchBackend`."""
from unified.registry import BackendSpec

SPEC = BackendSpec(
    name="torch",
    backend="backends.torch.core:TorchBackend",
    framework="torch",
    install="pip install 'unified[torch]'",
    launcher="backends.torch.launch:LAUNCHER",
    report="backends.torch.env:report",
    seed_globals="backends.torch.env:seed_globals",
    distributions=("torch",),
)
