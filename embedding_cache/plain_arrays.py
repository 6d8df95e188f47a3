"""Read a segment's small uncompressed zarr v3 arrays (`keys`, `offsets`) without zarr.

Building a run index reads the keys and offsets of every segment of a store: two arrays per segment, 8,000 at 10⁷
captions in 4,000 segments. zarr's read path costs ~3 ms of CPU per array (opening it and its codec pipeline), a
plain file read ~0.2 ms. These arrays are what `SegmentWriter.finish` writes: a regular chunk grid, the `bytes`
codec alone (little-endian), so each chunk file is the chunk's values in C order. Any other layout is refused in
one line rather than misread.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.core.errors import UserError


def read_plain_array(array_dir: Path) -> np.ndarray:
    """The whole array stored in `array_dir` (its `zarr.json` and chunk files), as zarr would return it: chunks
    concatenated along the first axis, a chunk file that is absent read as the fill value."""
    meta = json.loads((array_dir / "zarr.json").read_text())
    codecs = meta["codecs"]
    grid = meta["chunk_grid"]
    if (
        len(codecs) != 1
        or codecs[0]["name"] != "bytes"
        or codecs[0].get("configuration", {}).get("endian", "little") != "little"
        or grid["name"] != "regular"
        or meta["chunk_key_encoding"]["name"] != "default"
    ):
        raise UserError(f"{array_dir}: not an uncompressed little-endian array as a store segment writes it")
    shape = tuple(meta["shape"])
    chunk_shape = tuple(grid["configuration"]["chunk_shape"])
    if chunk_shape[1:] != shape[1:]:
        raise UserError(f"{array_dir}: chunked along more than its first axis")
    dtype = np.dtype(meta["data_type"]).newbyteorder("<")
    separator = meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
    out = np.empty(shape, dtype=dtype)
    rows = chunk_shape[0]
    for c, lo in enumerate(range(0, shape[0], rows)):
        hi = min(lo + rows, shape[0])
        path = array_dir / separator.join(["c", str(c), *(["0"] * (len(shape) - 1))])
        try:
            raw = np.fromfile(path, dtype=dtype)
        except FileNotFoundError:
            out[lo:hi] = meta["fill_value"]
            continue
        if raw.size != int(np.prod(chunk_shape)):
            raise UserError(
                f"{path}: {raw.nbytes} bytes, not a whole chunk; the store is damaged (run `tcjepa store verify`)"
            )
        out[lo:hi] = raw.reshape(chunk_shape)[: hi - lo]
    return out.astype(dtype.newbyteorder("="), copy=False)
