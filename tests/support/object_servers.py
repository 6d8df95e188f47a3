"""Object storage servers on loopback for the remote tests: S3 (moto, in process) and Azure Blob (Azurite, a Node
process from the npm registry that `make venv` installs under .venv/azurite), their environments, and buckets on them.

A test written for one back-end runs on both through `bucket_on(server, scheme, name)` and `f"{scheme}://{name}/..."`.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.processes import kill_tree, start
from tests.support.repo import REPO

# Azurite's fixed development account and key (published in its documentation; it accepts no other).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE = REPO / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
SCHEMES = ("s3", "az")


def bucket_on(server: dict[str, str], scheme: str, name: str) -> Any:
    """An fsspec file system on the session's server of `scheme` (s3: moto, az: Azurite), with the bucket (Azure:
    container) `name` made."""
    if scheme == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(
            key=server["AWS_ACCESS_KEY_ID"],
            secret=server["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=server["AWS_ENDPOINT_URL"],
            skip_instance_cache=True,
        )
    else:
        import adlfs

        fs = adlfs.AzureBlobFileSystem(
            connection_string=server["AZURE_STORAGE_CONNECTION_STRING"], skip_instance_cache=True
        )
    fs.mkdir(name)
    return fs


def s3_bucket(server: dict[str, str], name: str) -> Any:
    """An s3fs file system on the session's S3 server (`s3_server`), with the bucket `name` made."""
    return bucket_on(server, "s3", name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def azurite(folder: Path, timeout: float = 60) -> Iterator[dict[str, str]]:
    """Azurite's blob service on a free loopback port, its data in `folder`, for as long as the context lasts; the
    environment variables through which adlfs (the connection string) and obstore (the emulator switch and its URL)
    reach it. Ended by its process id."""
    binary = AZURITE if AZURITE.exists() else shutil.which("azurite-blob")
    if binary is None:
        raise RuntimeError(f"Azurite is not installed ({AZURITE}): run `make azurite`, which installs it with npm")
    port = _free_port()
    proc = start(
        [str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(folder)]
        + ["--silent", "--skipApiVersionCheck", "--disableTelemetry", "--loose"],
        quiet=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not _listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Azurite did not start on port {port} (exit status {proc.poll()})")
            time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        yield {
            "AZURE_STORAGE_CONNECTION_STRING": (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
            ),
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": endpoint,
        }
    finally:
        kill_tree(proc)
