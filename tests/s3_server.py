"""A local S3-compatible server for tests (moto's server mode on 127.0.0.1), never the network.

``local_s3(bucket)`` starts it, creates the bucket and yields the endpoint URL; processes that
should use it call ``use_endpoint(url)`` (fsspec's default ``s3`` options: endpoint and dummy
credentials), which ``LDT_TEST_S3_ENDPOINT`` carries into launched ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

ENV = "LDT_TEST_S3_ENDPOINT"


def use_endpoint(url: str) -> dict:
    """Point fsspec's s3 filesystem at ``url``; returns the options it replaced."""
    import fsspec
    import s3fs

    saved = dict(fsspec.config.conf.get("s3", {}))
    fsspec.config.conf["s3"] = {"endpoint_url": url, "key": "testing", "secret": "testing",
                                "client_kwargs": {"region_name": "us-east-1"}}
    s3fs.S3FileSystem.clear_instance_cache()
    return saved


@contextmanager
def local_s3(bucket: str) -> Iterator[str]:
    import boto3
    import fsspec
    import s3fs
    from dist_utils import free_port
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    saved = use_endpoint(url)
    boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    try:
        yield url
    finally:
        fsspec.config.conf["s3"] = saved
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()
