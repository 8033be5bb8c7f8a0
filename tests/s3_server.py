"""A real S3 endpoint for the tests: moto's S3 server on a free loopback port (the S3 wire protocol, no cloud
account), so a store at ``s3://...`` goes through the same code as on AWS, MinIO or Ceph."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3ResultRootFix:
    """WSGI middleware: moto 5 answers CompleteMultipartUpload with a ``CompleteMultipartUploadResponse``
    root element where S3 (and Arrow's AWS SDK, which checks it) uses ``CompleteMultipartUploadResult``;
    every other byte is moto's."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] != "POST" or "uploadId=" not in environ.get("QUERY_STRING", ""):
            return self.app(environ, start_response)
        captured = {}

        def capture(status, headers, exc_info=None):
            captured.update(status=status, headers=headers)

        body = b"".join(self.app(environ, capture)).replace(
            b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult"
        )
        headers = [(k, str(len(body)) if k.lower() == "content-length" else v) for k, v in captured["headers"]]
        start_response(captured["status"], headers)
        return [body]


@contextlib.contextmanager
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Serve S3 on loopback for the block, its credentials in the environment; yields ``host:port``."""
    pytest.importorskip("moto.moto_server.werkzeug_app", reason="moto[server] (a dev dependency) is not installed")
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = S3ResultRootFix(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def s3_store_uri(endpoint: str, bucket: str, prefix: str) -> str:
    """The URI of a store under ``bucket/prefix`` of the endpoint, the bucket made first."""
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                           access_key="testing", secret_key="testing", allow_bucket_creation=True)
    fs.create_dir(bucket)
    return f"s3://{bucket}/{prefix}?endpoint_override={endpoint}&scheme=http&region=us-east-1"
