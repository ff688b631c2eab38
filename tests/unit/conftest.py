"""Fixtures shared by the unit tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def torch_accelerator():
    """A one-process torch `Accelerator`, ended after the test."""
    pytest.importorskip("torch")
    from unified import Accelerator

    acc = Accelerator(backend="torch")
    yield acc
    acc.end_training()


@pytest.fixture(scope="module", params=["s3", "gs"])
def server(request):
    """The S3 server (moto) and the GCS emulator (gcp-storage-emulator), each on loopback."""
    from unified.testing.object_store import gcs_server, missing_gcs_packages, s3_server

    if request.param == "gs" and missing_gcs_packages():
        pytest.skip(missing_gcs_packages())
    with (s3_server() if request.param == "s3" else gcs_server()) as running:
        yield running


@pytest.fixture
def bucket(server):
    """A fresh bucket: ``s3://NAME``, and the fsspec file system that reaches it."""
    return server.bucket(), server.filesystem()
