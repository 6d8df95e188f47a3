"""Buckets on the session's S3-compatible server (`s3_server`)."""

from __future__ import annotations

from typing import Any


def s3_bucket(server: dict[str, str], name: str) -> Any:
    """An s3fs file system on the session's S3 server (`s3_server`), with the bucket `name` made."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=server["AWS_ACCESS_KEY_ID"],
        secret=server["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=server["AWS_ENDPOINT_URL"],
        skip_instance_cache=True,
    )
    fs.mkdir(name)
    return fs
