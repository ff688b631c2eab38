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
import sys
import uuid
from typing import Any, Iterator, Optional, Tuple

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

    def stop(self) -> None:
        """Stop answering (connections are refused); what the store holds is kept for `start`."""
        self.server.stop()

    def start(self) -> None:
        """Answer again, on the same port, with what the store held when it stopped (moto keeps
        its buckets in this process)."""
        from moto.server import ThreadedMotoServer

        host, port = self.endpoint.split("://", 1)[1].rsplit(":", 1)
        self.server = ThreadedMotoServer(ip_address=host, port=int(port), verbose=False)
        self.server.start()

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint)

    def bucket(self) -> str:
        """A new empty bucket: ``s3://NAME``."""
        name = f"run-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return f"s3://{name}"


def _forget_clients() -> None:
    """fsspec keeps one client per set of arguments, which read the environment when made."""
    if importlib.util.find_spec("s3fs") is not None:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


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
    _forget_clients()  # a client made before reads another endpoint from the environment
    running = LoopbackS3(server, endpoint)
    try:
        yield running
    finally:
        running.stop()
        _forget_clients()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class FaultyEndpoint:
    """An HTTP proxy on 127.0.0.1 (a free port) in front of a store's ``upstream`` endpoint that
    forwards every request unchanged, except those a test chose to fail: they get an S3 error
    response (``status``, ``code``) instead of reaching the store, and ``then`` (if given) runs
    first, with the request's method and path (a test kills a process there, mid-upload).
    Clients reach it by its ``endpoint``, as they would the store.

    Example:
        >>> with s3_server() as server, FaultyEndpoint(server.endpoint) as faulty:
        ...     faulty.fail(2, status=503, code="SlowDown", method="PUT")  # the next two PUTs
        ...     os.environ["AWS_ENDPOINT_URL"] = faulty.endpoint
    """

    def __init__(self, upstream: str) -> None:
        import http.server
        import threading

        self.upstream = upstream.split("://", 1)[-1]
        self.injected: list = []  # (method, path, status) of every request failed (status None: dropped)
        self._rule: Optional[dict] = None
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet: the test reports what it checks
                pass

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                except (ConnectionError, OSError):
                    self.close_connection = True

            def _forward(self) -> None:
                body = self._body()
                failure = proxy._take(self.command, self.path)
                if failure is not None and failure["status"] is None:  # a connection dropped without an answer
                    import socket

                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if failure is not None:
                    self._reply(failure["status"], {"Content-Type": "application/xml"},
                                b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>' + failure["code"].encode()
                                + b"</Code><Message>injected by FaultyEndpoint</Message></Error>")
                    return
                status, headers, data = proxy._send(self.command, self.path, dict(self.headers.items()), body)
                self._reply(status, headers, data)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(size + 2)
                        if size == 0:
                            while chunk not in (b"\r\n", b""):  # trailers
                                chunk = self.rfile.readline()
                            return data
                        data += chunk[:-2]
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, headers: dict, data: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)) if self.command != "HEAD"
                                 else headers.get("Content-Length", headers.get("content-length", "0")))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-endpoint", daemon=True)
        self._thread.start()

    def fail(self, count: Optional[int], status: Optional[int] = 503, code: str = "SlowDown",
             method: Optional[str] = None, containing: str = "", then: Optional[Any] = None) -> None:
        """Answer the next ``count`` requests (``None``: every one until `heal`) whose method is
        ``method`` (any when None) and whose path contains ``containing`` with ``status``/``code``,
        or (``status=None``) drop their connection without an answer."""
        with self._lock:
            self._rule = {"count": count, "status": status, "code": code, "method": method,
                          "containing": containing, "then": then}

    def heal(self) -> None:
        """Forward every request again."""
        with self._lock:
            self._rule = None

    def _take(self, method: str, path: str) -> Optional[dict]:
        with self._lock:
            rule = self._rule
            if rule is None or (rule["method"] not in (None, method)) or rule["containing"] not in path:
                return None
            if rule["count"] is not None:
                rule["count"] -= 1
                if rule["count"] <= 0:
                    self._rule = None
            self.injected.append((method, path, rule["status"]))
        if rule["then"] is not None:
            rule["then"](method, path)
        return rule

    def _send(self, method: str, path: str, headers: dict, body: bytes) -> Tuple[int, dict, bytes]:
        import http.client

        connection = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                    connection.putheader(name, value)
            connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            connection.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FaultyEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def requests_through(endpoint: str, max_attempts: int = 3) -> Iterator[None]:
    """Send this process's store requests to ``endpoint`` (a `FaultyEndpoint`), with the S3
    client's attempts per request set to ``max_attempts`` (botocore's standard retry mode, with
    backoff); both put back at the end. Clients made before are forgotten, so that the next one
    reads the environment.

    Example:
        >>> with FaultyEndpoint(server.endpoint) as faulty, requests_through(faulty.endpoint):
        ...     faulty.fail(None, status=500, code="InternalError")
    """
    names = ("AWS_ENDPOINT_URL", "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_RETRY_MODE="standard", AWS_MAX_ATTEMPTS=str(max_attempts))
    _forget_clients()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _forget_clients()


# -- Google Cloud Storage: gcp-storage-emulator, a GCS JSON API server in Python, in this process

GCS_EXTRA = "pip install 'unified[test]' (gcp-storage-emulator and gcsfs)"
_GCS_VARIABLES = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def missing_gcs_packages() -> Optional[str]:
    """Why the loopback GCS emulator cannot run here (a package to install), or None."""
    absent = [name for name in ("gcp_storage_emulator", "gcsfs") if importlib.util.find_spec(name) is None]
    return f"needs {', '.join(absent)}: {GCS_EXTRA}" if absent else None


class LoopbackGCS:
    """A running GCS emulator: its ``endpoint``, and fresh buckets on it."""

    def __init__(self, server: Any, endpoint: str) -> None:
        self.server, self.endpoint = server, endpoint

    def filesystem(self) -> Any:
        import gcsfs

        return gcsfs.GCSFileSystem(token="anon")

    def bucket(self) -> str:
        """A new empty bucket: ``gs://NAME``."""
        name = f"run-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return f"gs://{name}"


def _forget_gcs_clients() -> None:
    if importlib.util.find_spec("gcsfs") is not None:
        import gcsfs

        gcsfs.GCSFileSystem.clear_instance_cache()


@contextlib.contextmanager
def gcs_server() -> Iterator[LoopbackGCS]:
    """Start gcp-storage-emulator on 127.0.0.1 (a free port, objects in memory), point gcsfs at
    it (``STORAGE_EMULATOR_HOST``; it then sends no credentials), and put the environment back
    and stop it at the end. What it lacks against GCS: preconditions (``ifGenerationMatch``) are
    not honoured, and its etag is the content's MD5 where GCS gives each write a new one.

    Example:
        >>> with gcs_server() as server:
        ...     accelerator.save_state(f"{server.bucket()}/ckpt")
    """
    from gcp_storage_emulator.server import create_server

    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    httpd = server._api._httpd
    port = httpd.server_address[1]  # the port the system chose
    report = httpd.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        # a client that stopped reading a range early is not an error of the test: no traceback
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            report(request, client_address)

    httpd.handle_error = handle_error
    endpoint = f"http://127.0.0.1:{port}"
    saved = {name: os.environ.get(name) for name in _GCS_VARIABLES}
    # gcsfs asks each bucket's type of an API the emulator lacks, logging a warning every time
    os.environ.update(STORAGE_EMULATOR_HOST=endpoint, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    _forget_gcs_clients()
    try:
        yield LoopbackGCS(server, endpoint)
    finally:
        server.stop()
        _forget_gcs_clients()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
