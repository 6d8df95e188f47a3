"""Conditional writes and listings on object storage (obstore): a lost race is a typed outcome, never an error text.

S3, GCS and Azure each offer a put that creates an object only if none is there, and one that replaces an object only
if it still has the ETag it was read with (compare-and-swap). obstore gives both on every back-end, with typed errors
(`AlreadyExistsError`, `PreconditionError`), and lists keys after a given one (S3's `start-after`), so that reading a
log's new entries costs the same however long its history. The publication layer (`pipeline.core.remote`) decides on
those types alone, and reads the log through it; the files of shards and segments are still uploaded and fetched
through fsspec, which `datasets` needs too.

Credentials and endpoints come from each cloud's environment variables (obstore's `from_url`): for S3 the AWS ones,
e.g. `AWS_ENDPOINT_URL` for an S3-compatible server (an http:// endpoint is allowed); for GCS
`GOOGLE_SERVICE_ACCOUNT` (or `GOOGLE_APPLICATION_CREDENTIALS`); for Azure `AZURE_STORAGE_ACCOUNT_NAME` with
`AZURE_STORAGE_ACCOUNT_KEY` (or `AZURE_STORAGE_SAS_TOKEN`, which adlfs reads too).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import UserError

# One S3 list request returns at most this many keys (GCS and Azure page likewise); `requests` counts pages.
LIST_PAGE = 1000


@dataclass(frozen=True)
class Stored:
    """An object's bytes and the ETag to replace it with (None where the back-end gives none)."""

    data: bytes
    etag: str | None


@dataclass(frozen=True)
class Listed:
    """One listed object: its name under the root, its size, and when it was last written (seconds since the epoch)."""

    name: str
    size: int
    modified: float


class ObjectRoot:
    """The objects under one URL (`store` is an obstore store rooted there): create if absent, replace if unchanged,
    read, and list after a name. `requests` counts the requests made, by kind, and `bytes_read` what they read.

    `lists_after`: whether the back-end lists from a given name on (S3's `start-after`). Azure's List Blobs has no
    such parameter (only an opaque continuation marker): obstore then lists the whole prefix and drops what comes
    before the name, a request per 5,000 names, so the publish log reads such a back-end by name instead
    (`pipeline.core.remote.PublishLog`)."""

    def __init__(self, url: str, store: Any, lists_after: bool | None = None) -> None:
        from obstore.store import AzureStore

        self.url, self.store = url, store
        self.lists_after = not isinstance(store, AzureStore) if lists_after is None else lists_after
        self.requests: Counter[str] = Counter()
        self.bytes_read = 0

    @classmethod
    def of(cls, url: str) -> ObjectRoot:
        """The root at `url` (s3://, gs://, az://, memory://, file://), with credentials from the environment."""
        from obstore.store import from_url

        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or ""
        local_s3 = url.lower().startswith(("s3://", "s3a://")) and endpoint.startswith("http://")
        try:
            if local_s3:  # an S3-compatible server on plain http (obstore refuses http unless told)
                return cls(url, from_url(url.rstrip("/"), client_options={"allow_http": True}))
            return cls(url, from_url(url.rstrip("/")))
        except Exception as exc:  # obstore raises its own types for an unknown scheme or a bad configuration
            raise UserError(f"{url}: cannot open for conditional writes ({_first_line(exc)})") from None

    def create(self, name: str, data: bytes) -> bool:
        """Put `data` at `name` only if nothing is there: False when something is (or another put of it is landing)."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        self.requests["put"] += 1
        try:
            self.store.put(name, data, mode="create")
        except (AlreadyExistsError, PreconditionError):
            return False
        except Exception as exc:
            raise self._error(exc) from None
        return True

    def create_or_read(self, name: str, data: bytes, tries: int = 20) -> bytes:
        """Put `data` at `name` unless something is there; what is there now (the first writer's bytes)."""
        for attempt in range(tries):
            if self.create(name, data):
                return data
            there = self.read(name)
            if there is not None:
                return there.data
            time.sleep(0.05 * 2 ** min(attempt, 5))  # refused while another put of it lands: look again shortly
        raise UserError(f"{self.url}/{name}: refused {tries} times but never readable; try again later")

    def replace(self, name: str, data: bytes, etag: str | None) -> bool:
        """Put `data` at `name` only if the object there still has `etag` (None: only if there is none); False when
        it changed since it was read."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        if etag is None:
            return self.create(name, data)
        self.requests["put"] += 1
        try:
            self.store.put(name, data, mode={"e_tag": etag})
        except (AlreadyExistsError, PreconditionError, FileNotFoundError):
            return False
        except Exception as exc:
            raise self._error(exc) from None
        return True

    def read(self, name: str) -> Stored | None:
        """The object at `name`, or None when there is none."""
        self.requests["get"] += 1
        try:
            result = self.store.get(name)
            data = bytes(result.bytes())
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._error(exc) from None
        self.bytes_read += len(data)
        return Stored(data, result.meta.get("e_tag"))

    def names(self, prefix: str, after: str | None = None) -> list[str]:
        """The names under `prefix/` (at any depth, relative to it) that sort after `after`, in order."""
        offset = f"{prefix}/{after}" if after is not None else None
        return [meta["path"][len(prefix) + 1 :] for meta in self._list(prefix, offset)]

    def listing(self, prefix: str) -> list[Listed]:
        """Every object under `prefix/` (at any depth): its name relative to the root, size and last modification."""
        return [Listed(m["path"], int(m["size"]), m["last_modified"].timestamp()) for m in self._list(prefix, None)]

    def _list(self, prefix: str, offset: str | None) -> list[dict[str, Any]]:
        """The listed objects' metadata, sorted by path; one request counted per page of what was returned (where the
        back-end cannot start after `offset`, it paged through the names before it too: `lists_after`)."""
        try:
            pages = self.store.list(f"{prefix}/", offset=offset) if offset else self.store.list(f"{prefix}/")
            metas = sorted((meta for page in pages for meta in page), key=lambda meta: meta["path"])
        except FileNotFoundError:
            metas = []
        except Exception as exc:
            raise self._error(exc) from None
        self.requests["list"] += max(1, -(-len(metas) // LIST_PAGE))
        return metas

    def delete(self, name: str) -> None:
        """Remove the object at `name` (nothing when there is none)."""
        self.requests["delete"] += 1
        try:
            self.store.delete(name)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._error(exc) from None

    def _error(self, exc: Exception) -> UserError:
        return UserError(f"{self.url}: {type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [""])[0][:200]
