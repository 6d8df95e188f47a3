"""embedding_cache/plain_arrays.py: a segment's keys and offsets read without zarr return what zarr returns, and any
other layout is refused rather than misread."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from embedding_cache.plain_arrays import read_plain_array
from pipeline.core.errors import UserError


def _write(path, data, chunks, **kwargs):
    array = zarr.create_array(str(path), shape=data.shape, chunks=chunks, dtype=data.dtype, **kwargs)
    array[:] = data
    return path


@pytest.mark.parametrize(
    ("shape", "dtype", "rows"),
    [((1000, 32), np.uint8, 1000), ((1001,), np.int64, 300), ((7, 32), np.uint8, 3), ((0, 32), np.uint8, 1)],
)
def test_reads_what_zarr_reads_over_whole_and_partial_chunks(tmp_path, shape, dtype, rows):
    rng = np.random.default_rng(0)
    data = rng.integers(1, 200, size=shape).astype(dtype)
    path = _write(tmp_path / "a", data, (rows, *shape[1:]), compressors=None, fill_value=0)
    got = read_plain_array(path)
    expected = zarr.open_array(str(path), mode="r")[:]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_a_chunk_zarr_left_unwritten_reads_as_the_fill_value(tmp_path):
    data = np.arange(1, 13, dtype=np.int64)
    data[4:8] = 7  # the fill value: zarr writes no file for a chunk holding only it
    path = _write(tmp_path / "a", data, (4,), compressors=None, fill_value=7)
    assert not (path / "c" / "1").exists()
    np.testing.assert_array_equal(read_plain_array(path), zarr.open_array(str(path), mode="r")[:])


def test_compressed_or_damaged_arrays_are_refused_in_one_line(tmp_path):
    data = np.arange(100, dtype=np.int64)
    compressed = _write(tmp_path / "z", data, (50,), fill_value=0)  # zarr's default compressor
    with pytest.raises(UserError, match="not an uncompressed little-endian array"):
        read_plain_array(compressed)
    plain = _write(tmp_path / "p", data, (50,), compressors=None, fill_value=0)
    chunk = plain / "c" / "1"
    chunk.write_bytes(chunk.read_bytes()[:-8])
    with pytest.raises(UserError, match=r"c/1: 392 bytes, not a whole chunk; the store is damaged"):
        read_plain_array(plain)
