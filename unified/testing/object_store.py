"""A real S3-compatible server on loopback for tests and benchmarks: moto's standalone server
(the one s3fs's own test suite runs against), started in this process on a free port. Clients
(s3fs, boto3, and every process the tests start, which inherit the environment) find it through
``AWS_ENDPOINT_URL``; the credentials are moto's test ones.

Example:
    >>> with s3_server() as server:
    ...     url = server.bucket()          # "s3://run-1a2b3c4d5e6f", empty
    ...     accelerator.save_state(f"{url}/ckpt")
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import uuid
from typing import Any, Iterator, Optional

STORE_EXTRA = "pip install 'unified[test]' (moto[server] and s3fs)"
_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def missing_store_packages() -> Optional[str]:
    """Why the loopback S3 server cannot run here (a package to install), or None."""
    absent = [name for name in ("moto", "s3fs") if importlib.util.find_spec(name) is None]
    return f"needs {', '.join(absent)}: {STORE_EXTRA}" if absent else None


class LoopbackS3:
    """A running server: its ``endpoint``, and fresh buckets on it."""

    def __init__(self, server: Any, endpoint: str) -> None:
        self.server, self.endpoint = server, endpoint

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint)

    def bucket(self) -> str:
        """A new empty bucket: ``s3://NAME``."""
        name = f"run-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return f"s3://{name}"


@contextlib.contextmanager
def s3_server() -> Iterator[LoopbackS3]:
    """Start the server on 127.0.0.1 (a free port), point the environment at it, and put the
    environment back and stop the server at the end."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    saved = {name: os.environ.get(name) for name in _VARIABLES}
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        yield LoopbackS3(server, endpoint)
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
