import hashlib

import numpy as np
import pytest

from pipeline.core.digests import DigestIndex, first_occurrence
from pipeline.core.recipes import canonical_json, recipe_hash, text_key


def test_canonical_json_is_order_and_whitespace_free():
    a = {"b": 1, "a": [1, 2, {"y": "é", "x": None}]}
    b = {"a": [1, 2, {"x": None, "y": "é"}], "b": 1}
    assert canonical_json(a) == canonical_json(b) == '{"a":[1,2,{"x":null,"y":"é"}],"b":1}'.encode()
    assert recipe_hash(a) == hashlib.sha256(canonical_json(a)).hexdigest()
    assert recipe_hash(a) != recipe_hash({**a, "b": 2})
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_text_key_is_sha256_of_utf8():
    assert text_key("a red ☂") == hashlib.sha256("a red ☂".encode()).digest()


def _keys(values):
    return np.stack([np.frombuffer(text_key(str(v)), dtype=np.uint8) for v in values])


def test_digest_index_lookup_across_many_runs():
    index = DigestIndex()
    for run in range(20):  # more runs than the merge threshold
        index.add(_keys(range(run * 10, run * 10 + 10)), np.arange(run * 10, run * 10 + 10))
    assert len(index) == 200
    found = index.lookup(_keys([0, 57, 199, 200, -1]))
    assert found.tolist() == [0, 57, 199, -1, -1]
    assert index.contains(_keys([5, 500])).tolist() == [True, False]


def test_digest_index_keeps_first_payload():
    index = DigestIndex()
    index.add(_keys([1]), np.array([10]))
    index.add(_keys([1]), np.array([99]))
    assert index.lookup(_keys([1])).tolist() == [10]
    for _ in range(10):
        index.add(_keys([2]), np.array([7]))
    assert index.lookup(_keys([1])).tolist() == [10]


def test_digest_index_keeps_the_first_payload_of_a_digest_repeated_within_one_run():
    """One add of many repeats among other keys: the sort must keep equal digests in insertion order."""
    rng = np.random.default_rng(0)
    keys = _keys(rng.permutation(np.repeat(np.arange(50), 40)))
    index = DigestIndex()
    index.add(keys, np.arange(len(keys)))
    first = {bytes(k[:16]): i for i, k in reversed(list(enumerate(keys)))}
    assert index.lookup(_keys(range(50))).tolist() == [first[bytes(k[:16])] for k in _keys(range(50))]


def test_first_occurrence():
    assert first_occurrence(_keys([3, 1, 3, 2, 1])).tolist() == [True, True, False, True, False]


def test_weight_hashes_are_remembered_by_path_size_mtime_and_inode(tmp_path, monkeypatch):
    import os

    from pipeline.core.recipes import remembered_sha256, sha256_file, sha256_tree

    monkeypatch.setenv("TCJEPA_CACHE_DIR", str(tmp_path / "cache"))
    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"a" * 1000)
    first = remembered_sha256(weights)
    assert first == sha256_file(weights) and len(list((tmp_path / "cache" / "file-sha256").iterdir())) == 1
    # Rewritten in place with the same size and mtime: the remembered hash is served (the file is not read again).
    stat = weights.stat()
    with open(weights, "r+b") as f:
        f.write(b"b")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert remembered_sha256(weights) == first
    # Replaced (a new mtime): hashed again.
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert remembered_sha256(weights) == sha256_file(weights) != first
    assert sha256_tree(weights.parent, ["model.safetensors"], remember=True) == sha256_tree(
        weights.parent, ["model.safetensors"]
    )


def test_digest_index_tells_digests_that_share_their_first_8_bytes_apart_and_keeps_first_payloads():
    import numpy as np

    from pipeline.core.digests import DigestIndex

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size=(1, 32), dtype=np.uint8)
    twins = np.repeat(base, 4, axis=0)
    twins[:, 8] = [1, 2, 3, 4]  # same 64-bit prefix, different digests
    index = DigestIndex()
    index.add(twins[:2], np.array([10, 20]))
    for k in range(40):  # many runs, merged as they come
        index.add(rng.integers(0, 256, size=(50, 32), dtype=np.uint8), np.arange(50) + 1000 * (k + 1))
    index.add(twins, np.array([30, 40, 50, 60]))  # two repeats (first payload wins) and two new ones
    assert index.lookup(twins).tolist() == [10, 20, 50, 60]
    other = twins.copy()
    other[:, 9] = 99  # prefix present, digest absent
    assert not index.contains(other).any() and len(index) == 2 + 40 * 50 + 4


def test_a_large_lookup_runs_in_bounded_parts_on_lookup_threads_and_finds_what_one_part_finds(monkeypatch):
    """Keys present, absent, repeated in the query and sharing a 64-bit prefix, split into parts of at most
    `KEYS_PER_LOOKUP_PART` keys (1,000 here): each part on a lookup thread, and the answer the same as one part's, in
    the query's order."""
    import threading

    from pipeline.core import digests

    rng = np.random.default_rng(1)
    stored = rng.integers(0, 256, size=(3000, 32), dtype=np.uint8)
    stored[1, :8] = stored[0, :8]  # a prefix twin
    index = DigestIndex()
    for part in np.array_split(np.arange(len(stored)), 7):
        index.add(stored[part], part + 100)
    absent = rng.integers(0, 256, size=(500, 32), dtype=np.uint8)
    absent[0, :8] = stored[0, :8]  # its prefix stored, not its digest
    query = np.concatenate([stored, absent, stored[::-3]])[rng.permutation(3000 + 500 + 1000)]
    expected = {bytes(k[:16]): i + 100 for i, k in enumerate(stored)}
    want = [expected.get(bytes(k[:16]), -1) for k in query]
    assert index.lookup(query).tolist() == want, "one part"

    threads: list[str] = []
    one_part = DigestIndex._lookup
    monkeypatch.setattr(digests, "KEYS_PER_LOOKUP_PART", 1000)
    monkeypatch.setattr(digests, "usable_cpus", lambda: 3)
    monkeypatch.setattr(
        DigestIndex,
        "_lookup",
        lambda self, keys: threads.append((threading.current_thread().name, len(keys))) or one_part(self, keys),
    )
    assert index.lookup(query).tolist() == want
    assert sorted(n for _, n in threads) == [500, 1000, 1000, 1000, 1000], "parts of at most 1,000 keys"
    names = {name for name, _ in threads}
    assert len(names) <= 3 and all(name.startswith("tcjepa-lookup") for name in names), names
