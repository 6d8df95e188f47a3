import gc
import json

import numpy as np
import pytest
import zarr

from embedding_cache.reader import EmbeddingReader, StoreKeys
from embedding_cache.store import EmbeddingStore, TokenLayout
from pipeline.core.errors import UserError
from pipeline.core.recipes import text_key
from tests.support.stores import TEST_ENCODER as ENC
from tests.support.stores import TEST_LAYOUT as LAYOUT
from tests.support.stores import TEST_WIDTH as D
from tests.support.stores import numbered_caption as _caption
from tests.support.stores import publish_captions as _write


def test_reader_returns_exactly_what_zarr_returns(tmp_path):
    store = EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    _write(store, range(0, 50))
    _write(store, range(50, 53))
    reader = EmbeddingReader(tmp_path / "s")
    assert len(reader) == 53 and reader.width == D
    root = zarr.open_group(str(tmp_path / "s"), mode="r")
    seen = 0
    for seg in root.attrs["tcjepa"]["segments"]:
        g = root["segments"][seg]
        tokens, offsets, keys = g["tokens"], g["offsets"][:], g["keys"][:]
        assert tokens.dtype == np.float16 and tokens.shards == (64, D) and tokens.compressors == ()
        assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0) and offsets[-1] == tokens.shape[0]
        rows = reader.locate(keys)
        for i, row in enumerate(rows):
            expected = tokens[offsets[i] : offsets[i + 1]]
            got = reader.get(int(row))
            assert got.dtype == np.float16 and np.array_equal(got, expected)
            seen += 1
    assert seen == 53
    for i in (0, 17, 52):
        key, arr = _caption(i)
        assert np.array_equal(reader.get_key(key), arr)
    assert reader.locate(np.frombuffer(text_key("absent"), dtype=np.uint8)[None]).tolist() == [-1]
    with pytest.raises(KeyError):
        reader.get_key(text_key("absent"))


def test_store_keys_name_the_segments_that_hold_given_captions(tmp_path):
    """What a training node fetches from a remote store is decided from the keys alone: it must name exactly the
    segments that hold the index's captions, agree with the reader's rows, and refuse a key the store lacks."""
    store = EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    first, second, third = (_write(store, ids).segment for ids in (range(0, 20), range(20, 30), range(30, 45)))
    keys = StoreKeys(store)

    def key_array(ids):
        return np.stack([np.frombuffer(_caption(i)[0], dtype=np.uint8) for i in ids])

    assert len(keys) == 45 and keys.segment_ids == [first, second, third]
    assert np.array_equal(
        keys.locate(key_array(range(45))), EmbeddingReader(tmp_path / "s").locate(key_array(range(45)))
    )
    assert keys.segments_holding(key_array([25, 21])) == [second]
    assert keys.segments_holding(key_array([44, 0, 19])) == [first, third], "in store order, each once"
    assert keys.segments_holding(key_array([20, 29, 30])) == [second, third], "segment boundaries"
    absent = np.frombuffer(text_key("absent"), dtype=np.uint8)[None]
    with pytest.raises(UserError, match="1 caption keys are not in the store"):
        keys.segments_holding(np.concatenate([key_array([3]), absent]))


def test_gather_padded(tmp_path):
    store = EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    w = store.new_segment(LAYOUT)
    for i, n in enumerate([3, 0, 5]):
        w.append(*_caption(i, n))
    w.finish()
    store.publish(w)
    reader = EmbeddingReader(tmp_path / "s")
    rows = reader.locate(np.stack([np.frombuffer(_caption(i, 0)[0], dtype=np.uint8) for i in (2, 1, 0)]))
    batch, lengths = reader.gather_padded(np.append(rows, -1))
    assert batch.shape == (4, 5, D) and lengths.tolist() == [5, 0, 3, 0]
    assert np.array_equal(batch[0], _caption(2, 5)[1]) and not batch[1].any() and not batch[3].any()
    assert np.array_equal(batch[2, :3], _caption(0, 3)[1]) and not batch[2, 3:].any()
    capped, lengths = reader.gather_padded(rows, max_len=4)
    assert capped.shape[1] == 4 and lengths.tolist() == [4, 0, 3]


def test_store_refuses_another_encoder_and_foreign_dirs(tmp_path):
    EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    with pytest.raises(UserError, match="another encoder recipe.*differs in: max_length"):
        EmbeddingStore.open_or_create(tmp_path / "s", {**ENC, "max_length": 128}, D)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file").write_text("x")
    with pytest.raises(UserError, match="not an embedding store"):
        EmbeddingStore.open_or_create(tmp_path / "junk", ENC, D)
    zarr.open_group(str(tmp_path / "plainzarr"), mode="w")
    with pytest.raises(UserError, match="not a tcjepa embedding store"):
        EmbeddingReader(tmp_path / "plainzarr")


def test_root_metadata_is_plain_zarr(tmp_path):
    store = EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    _write(store, range(3))
    meta = json.loads((tmp_path / "s" / "zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["node_type"] == "group"
    attrs = meta["attributes"]["tcjepa"]
    assert attrs["encoder"] == ENC and attrs["d_model"] == D and len(attrs["segments"]) == 1


def test_layout_for_bytes():
    layout = TokenLayout.for_bytes(768)
    assert layout.chunk_tokens * 768 * 2 <= 16 << 20 and layout.shard_tokens * 768 * 2 <= 1 << 30
    assert layout.shard_tokens * 768 * 2 > 1 << 29


def _open_files_under(root) -> int:
    """File descriptors of this process open on files under `root`."""
    import os

    fds = os.listdir("/proc/self/fd")
    return sum(os.path.realpath(f"/proc/self/fd/{fd}").startswith(os.path.realpath(root)) for fd in fds)


def test_shard_files_are_mapped_lazily_and_never_more_than_the_bound(tmp_path):
    """More segments than the bound: every caption still reads right, and no more than `max_open_files` shard files
    are open at any time (counted in /proc, not asked of the reader)."""
    store = EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    for first in range(0, 60, 10):
        _write(store, range(first, first + 10))
    reader = EmbeddingReader(tmp_path / "s", max_open_files=2)
    assert len(reader.files) == 0 and _open_files_under(tmp_path / "s") == 0, "opening maps nothing"
    keys = np.stack([np.frombuffer(_caption(i)[0], dtype=np.uint8) for i in range(60)])
    rows = reader.locate(keys)
    most = 0
    for order in (np.arange(60), np.random.default_rng(0).permutation(60)):
        for start in range(0, 60, 7):
            tokens, offsets = reader.gather_packed(rows[order[start : start + 7]])
            for j, i in enumerate(order[start : start + 7].tolist()):
                assert np.array_equal(tokens[offsets[j] : offsets[j + 1]], _caption(i)[1])
            del tokens
            gc.collect()
            most = max(most, _open_files_under(tmp_path / "s"))
    assert 0 < most <= 2 and len(reader.files) <= 2
    assert reader.files.opened > 6, "files dropped by the bound were mapped again when needed"


def test_spans_of_keys_are_where_the_key_lookup_points(tmp_path):
    store = EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    for first in range(0, 30, 10):
        _write(store, range(first, first + 10))
    keys = np.stack([np.frombuffer(_caption(i)[0], dtype=np.uint8) for i in (25, 3, 14, 3)])
    segments, spans = StoreKeys(store).spans(keys)
    reader = EmbeddingReader(tmp_path / "s")
    by_rows = reader.spans_of_rows(reader.locate(keys))
    assert segments == reader.segment_ids, "every segment holds one of these keys"
    assert np.array_equal(spans.segment, by_rows.segment) and np.array_equal(spans.start, by_rows.start)
    assert spans.length.tolist() == [len(_caption(i)[1]) for i in (25, 3, 14, 3)]
    tokens, _, offsets = reader.gather_spans_raw(spans)
    for j, i in enumerate((25, 3, 14, 3)):
        assert np.array_equal(tokens[offsets[j] : offsets[j + 1]], _caption(i)[1])

    located = StoreKeys(store)  # as rank 0 does: every key located, the key index dropped, then the spans
    rows = located.locate(keys)
    located.drop_key_index()
    again = located.spans_of_rows(rows)
    assert again[0] == segments and np.array_equal(again[1].start, spans.start)
    with pytest.raises(RuntimeError, match="after drop_key_index"):
        located.locate(keys)


@pytest.mark.parametrize("few", [True, False])
def test_spans_of_few_rows_and_of_many_are_the_readers(tmp_path, few):
    """Few rows find their segments by a binary search over the segments' starts, many by a table of every stored
    row's segment: either way each row's span is the one the reader finds, in segments of unequal sizes (a
    segment's first and last rows among them)."""
    store = EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    for ids in (range(0, 10), range(10, 13), range(13, 30), range(30, 31)):
        _write(store, ids)
    captions = np.random.default_rng(0).permutation(31).tolist()
    located = StoreKeys(store)
    every = located.locate(np.stack([np.frombuffer(_caption(i)[0], dtype=np.uint8) for i in captions]))
    at_edges = [captions[every.tolist().index(row)] for row in (located.starts[1], located.starts[3] - 1)]
    chosen = at_edges if few else [*captions, *at_edges]
    rows = located.locate(np.stack([np.frombuffer(_caption(i)[0], dtype=np.uint8) for i in chosen]))
    segments, spans = located.spans_of_rows(rows)
    want = EmbeddingReader(tmp_path / "s").spans_of_rows(rows)
    assert segments == [located.segment_ids[i] for i in sorted(set(want.segment.tolist()))]
    assert [segments[i] for i in spans.segment] == [located.segment_ids[i] for i in want.segment]
    assert np.array_equal(spans.start, want.start) and np.array_equal(spans.length, want.length)
    assert spans.length.tolist() == [len(_caption(i)[1]) for i in chosen]
    for outside in (-1, 31):  # a row that is not the store's is refused, not wrapped to the last segment's
        with pytest.raises(IndexError, match="out of range for a store of 31 captions"):
            located.spans_of_rows(np.r_[rows, outside])


def test_a_damaged_shard_index_is_refused_by_the_reader_and_by_store_verify(tmp_path):
    """Each shard file ends with its index of inner chunks and that index's crc32c. A flipped bit in the index would
    send a memory-mapped read to the wrong bytes: the reader checks the crc when it first maps the shard (numcodecs'
    CRC32C) and refuses the file in one line, and `tcjepa store verify` reports it."""
    from tests.support.commands import refused

    store = EmbeddingStore.open_or_create(tmp_path / "s", ENC, D)
    _write(store, range(0, 20))
    shards = sorted((tmp_path / "s" / "segments").glob("*/tokens/c/*/*"))
    assert shards, "no shard file found"
    first = int(EmbeddingReader(tmp_path / "s").locate(np.frombuffer(_caption(0)[0], dtype=np.uint8)[None])[0])
    assert np.array_equal(EmbeddingReader(tmp_path / "s").get(first), _caption(0)[1])
    data = bytearray(shards[0].read_bytes())
    data[-10] ^= 0x01  # a bit of the index's last entry
    shards[0].write_bytes(bytes(data))
    with pytest.raises(UserError, match="its shard index fails its crc32c; the file is damaged") as caught:
        EmbeddingReader(tmp_path / "s").get(first)
    assert "\n" not in str(caught.value)
    done = refused("store", "verify", tmp_path / "s")
    assert done.returncode == 1 and "problem:" in done.stdout + done.stderr
