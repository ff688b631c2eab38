"""The PyTorch backend. This module is imported to read `SPEC` and imports no framework; the
backend itself is `backends.torch.core.TorchBackend`."""
from unified.backend.registry import BackendSpec

SPEC = BackendSpec(
    name="torch",
    backend="backends.torch.core:TorchBackend",
    framework="torch",
    install="pip install 'unified[torch]'",
    launcher="backends.torch.launch:LAUNCHER",
    report="backends.torch.env:report",
    seed_globals="backends.torch.env:seed_globals",
    distributions=("torch",),
    # 2.6: the oldest release with the public FSDP2 `fully_shard`; checked by hand (its Linux wheel
    # on PyPI pulls the CUDA libraries, see docs/adding-a-backend.md). 2.13: the main CI job.
    tested_versions=(("torch", "2.6.0", "2.13.0"),),
    private_apis="backends.torch.private:check",
    testing_kit="backends.torch.testing:TorchKit",
)
