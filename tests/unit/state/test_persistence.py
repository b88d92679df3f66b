"""Trie snapshots: exact round trips, atomic writes, and every bad file -> logged error + empty trie."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import struct
import subprocess

import numpy as np
import pytest

from lookahead.algorithm.retrieval import retrieve_draft
from lookahead.algorithm.trie import NO_NODE, NGramTrie
from lookahead.state.persistence import (
    FORMAT_VERSION,
    MAGIC,
    SnapshotInUse,
    claim_snapshot,
    load_trie,
    save_trie,
)

FINGERPRINT = "HuggingFaceTB/SmolLM2-135M-Instruct@tokenizer-sha256:0123"


@pytest.fixture
def trie() -> NGramTrie:
    rng = random.Random(0)
    trie = NGramTrie(capacity=50_000, max_depth=8)
    for _ in range(40):
        trie.writer().feed([rng.randrange(30) for _ in range(rng.randrange(5, 80))])
    return trie


def snapshot_of(trie: NGramTrie) -> dict[tuple[int, ...], tuple[float, list[int]]]:
    """Every path from the root with its count and its children in order."""
    found, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        kids = trie.children(node, limit=1 << 30)
        found[path] = (trie.count(node), [token for token, _, _ in kids])
        stack.extend((child, path + (token,)) for token, child, _ in kids)
    return found


def test_round_trip_keeps_nodes_counts_order_and_drafts(tmp_path, trie):
    path = tmp_path / "trie.bin"
    save_trie(trie, path, FINGERPRINT)
    loaded = load_trie(path, capacity=50_000, max_depth=8, fingerprint=FINGERPRINT)
    assert loaded.node_count == trie.node_count > 1_000
    assert snapshot_of(loaded) == snapshot_of(trie)
    rng = random.Random(1)
    for _ in range(50):
        context = [rng.randrange(30) for _ in range(4)]
        for mode in ("hier", "par", "one"):
            kwargs = dict(decoding_length=32, branch_length=4, mode=mode)
            assert retrieve_draft(context, None, loaded, **kwargs) == retrieve_draft(
                context, None, trie, **kwargs
            )
    loaded.writer().feed([1, 2, 3])  # a loaded trie keeps learning
    assert loaded.match([1, 2, 3]) != NO_NODE


def test_file_layout_and_atomic_replacement(tmp_path, trie):
    path = tmp_path / "trie.bin"
    path.write_bytes(b"an older snapshot")
    save_trie(trie, path, FINGERPRINT)
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    assert struct.unpack_from("<I", data, len(MAGIC))[0] == FORMAT_VERSION
    assert data[-32:] == hashlib.sha256(data[:-32]).digest()
    assert b'"fingerprint": "' + FINGERPRINT.encode() in data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trie.bin"]  # no temporary file left behind
    assert b"pickle" not in data and not data.startswith(b"\x80")


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, trie, monkeypatch):
    path = tmp_path / "trie.bin"
    path.write_bytes(b"previous")

    def broken_fsync(descriptor):
        raise OSError("disk full")

    monkeypatch.setattr("lookahead.state.persistence.os.fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        save_trie(trie, path, FINGERPRINT)
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["trie.bin"]


def test_missing_file_gives_an_empty_trie_and_an_info_log(tmp_path, caplog):
    path = tmp_path / "absent.bin"
    with caplog.at_level(logging.INFO, logger="lookahead"):
        loaded = load_trie(path, capacity=100, max_depth=8, fingerprint=FINGERPRINT)
    assert loaded.node_count == 0 and loaded.capacity == 100
    assert [(r.levelname, str(path) in r.getMessage()) for r in caplog.records] == [("INFO", True)]


def _corrupt_flip_a_column_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


def _corrupt_bump_version(data: bytes) -> bytes:
    return data[: len(MAGIC)] + struct.pack("<I", FORMAT_VERSION + 1) + data[len(MAGIC) + 4 :]


def _corrupt_other_model(data: bytes) -> bytes:
    body = data[:-32].replace(FINGERPRINT.encode(), FINGERPRINT.replace("SmolLM2", "SmolLM3").encode())
    return body + hashlib.sha256(body).digest()


def _corrupt_other_depth(data: bytes) -> bytes:
    body = data[:-32].replace(b'"max_depth": 8', b'"max_depth": 9')
    return body + hashlib.sha256(body).digest()


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_corrupt_flip_a_column_byte, "checksum mismatch (the file is corrupt)"),
        (lambda data: data[: len(data) - 100], "truncated or padded file"),
        (lambda data: data + b"\0", "truncated or padded file"),
        (lambda data: data[:10], "truncated file: 10 bytes"),
        (lambda data: data[:5], "not a trie snapshot (bad magic bytes)"),
        (lambda data: b"{}" + data, "not a trie snapshot (bad magic bytes)"),
        (_corrupt_bump_version, f"unsupported format version {FORMAT_VERSION + 1}"),
        (_corrupt_other_model, f"fingerprint {FINGERPRINT.replace('SmolLM2', 'SmolLM3')!r} does not match"),
        (_corrupt_other_depth, "max_depth 9 does not match the configured 8"),
    ],
)
def test_unusable_snapshot_is_logged_with_file_and_reason_and_gives_an_empty_trie(
    tmp_path, trie, caplog, corrupt, reason
):
    path = tmp_path / "trie.bin"
    save_trie(trie, path, FINGERPRINT)
    path.write_bytes(corrupt(path.read_bytes()))
    with caplog.at_level(logging.INFO, logger="lookahead"):
        loaded = load_trie(path, capacity=50_000, max_depth=8, fingerprint=FINGERPRINT)
    assert loaded.node_count == 0 and loaded.max_depth == 8
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and str(path) in errors[0] and reason in errors[0], errors


def test_wrong_fingerprint_is_refused_even_with_a_valid_file(tmp_path, trie, caplog):
    path = tmp_path / "trie.bin"
    save_trie(trie, path, FINGERPRINT)
    with caplog.at_level(logging.ERROR, logger="lookahead"):
        loaded = load_trie(path, capacity=50_000, max_depth=8, fingerprint="another-model")
    assert loaded.node_count == 0
    assert "does not match 'another-model' (saved for another model or tokenizer)" in caplog.text


def test_a_well_checksummed_but_malformed_trie_is_refused(tmp_path, caplog):
    trie = NGramTrie(capacity=100, max_depth=4)
    trie.insert([1, 2, 3])  # nodes 1..3 = unigrams, 4..5 = bigrams, 6 = the trigram under 4 under 1
    path = tmp_path / "trie.bin"
    save_trie(trie, path, FINGERPRINT)
    data = bytearray(path.read_bytes()[:-32])
    header_length = struct.unpack_from("<II", data, len(MAGIC))[1]
    parents_at = len(MAGIC) + 8 + header_length + 7 * 4  # after the 7 token ids
    assert np.frombuffer(data, "<i4", 7, parents_at).tolist() == [-1, 0, 0, 0, 1, 2, 4]
    data[parents_at + 4 : parents_at + 8] = struct.pack("<i", 6)  # node 1 under node 6: a cycle
    path.write_bytes(bytes(data) + hashlib.sha256(data).digest())
    with caplog.at_level(logging.ERROR, logger="lookahead"):
        loaded = load_trie(path, capacity=100, max_depth=4, fingerprint=FINGERPRINT)
    assert loaded.node_count == 0
    assert "inconsistent trie (some nodes are unreachable from the root" in caplog.text


def test_loading_into_a_smaller_capacity_evicts_down_to_the_bound(tmp_path):
    trie = NGramTrie(capacity=10_000, max_depth=4)
    rng = random.Random(2)
    writer = trie.writer()
    for _ in range(200):
        writer.feed([1, 2, 3, 4] + [rng.randrange(100, 5_000) for _ in range(5)])
    path = tmp_path / "trie.bin"
    save_trie(trie, path, FINGERPRINT)
    loaded = load_trie(path, capacity=50, max_depth=4, fingerprint=FINGERPRINT)
    assert trie.node_count > 1_000 and loaded.node_count <= 50
    assert loaded.match([1, 2, 3, 4]) != NO_NODE  # the frequent n-gram survives
    save_trie(loaded, path, FINGERPRINT)
    assert load_trie(path, capacity=50, max_depth=4, fingerprint=FINGERPRINT).node_count == loaded.node_count


def test_an_empty_trie_round_trips(tmp_path):
    path = tmp_path / "trie.bin"
    save_trie(NGramTrie(capacity=100, max_depth=4), path, FINGERPRINT)
    assert load_trie(path, capacity=100, max_depth=4, fingerprint=FINGERPRINT).node_count == 0


def test_a_snapshot_holding_token_ids_outside_the_vocabulary_is_refused(tmp_path, caplog):
    trie = NGramTrie(capacity=100, max_depth=4)
    trie.insert([1, 2, 300, 4])
    path = tmp_path / "t.trie"
    save_trie(trie, path, FINGERPRINT)
    assert load_trie(path, capacity=100, max_depth=4, fingerprint=FINGERPRINT, vocab_size=1000).node_count > 0
    with caplog.at_level(logging.ERROR, logger="lookahead"):
        loaded = load_trie(path, capacity=100, max_depth=4, fingerprint=FINGERPRINT, vocab_size=256)
    assert loaded.node_count == 0
    assert "token ids outside the model's vocabulary (size 256)" in caplog.text


# A snapshot is read at every model load: whatever the file holds, the load goes on.


def _resealed(data: bytes, header: bytes) -> bytes:
    """`data` with its header replaced by `header`, checksum recomputed."""
    header_length = struct.unpack_from("<I", data, len(MAGIC) + 4)[0]
    start = len(MAGIC) + 8
    body = data[: len(MAGIC)] + struct.pack("<II", FORMAT_VERSION, len(header)) + header
    body += data[start + header_length : -32]
    return body + hashlib.sha256(body).digest()


def _load_quietly(path, caplog) -> NGramTrie:
    with caplog.at_level(logging.ERROR, logger="lookahead"):
        return load_trie(path, capacity=1000, max_depth=8, fingerprint=FINGERPRINT, vocab_size=64)


@pytest.mark.parametrize(
    "node_count",
    ["Infinity", "-Infinity", "NaN", "-1", "1e400", "1.5", "true", "null", '"3"', "[]", str(2**64)],
)
def test_a_checksummed_header_with_an_impossible_node_count_gives_an_empty_trie(tmp_path, caplog, node_count):
    small = NGramTrie(capacity=100, max_depth=8)
    small.insert([1, 2, 3])
    path = tmp_path / "trie.bin"
    save_trie(small, path, FINGERPRINT)
    data = path.read_bytes()
    header_length = struct.unpack_from("<I", data, len(MAGIC) + 4)[0]
    raw = data[len(MAGIC) + 8 : len(MAGIC) + 8 + header_length].decode()
    assert f'"node_count": {small.node_count}' in raw
    raw = raw.replace(f'"node_count": {small.node_count}', f'"node_count": {node_count}')
    path.write_bytes(_resealed(path.read_bytes(), raw.encode()))
    assert _load_quietly(path, caplog).node_count == 0
    assert "Ignoring trie snapshot" in caplog.text and "starting with an empty trie" in caplog.text


@pytest.mark.parametrize(
    "header",
    [
        b"[]",
        b"null",
        b"1e999",
        b"[" * 100_000,
        b'{"node_count": 0}',
        b"\xff\xfe",
        b"",
        b'{"node_count": 99999999999}',
    ],
)
def test_a_checksummed_file_with_any_header_gives_an_empty_trie(tmp_path, caplog, header):
    path = tmp_path / "trie.bin"
    save_trie(NGramTrie(capacity=100, max_depth=8), path, FINGERPRINT)
    path.write_bytes(_resealed(path.read_bytes(), header))
    assert _load_quietly(path, caplog).node_count == 0
    assert "Ignoring trie snapshot" in caplog.text


def test_random_bytes_and_every_truncation_give_an_empty_trie(tmp_path, caplog):
    small = NGramTrie(capacity=100, max_depth=8)
    small.insert([1, 2, 3, 4, 5])
    path = tmp_path / "trie.bin"
    save_trie(small, path, FINGERPRINT)
    data = path.read_bytes()
    rng = random.Random(0)
    candidates = [data[:cut] for cut in range(len(data))]
    candidates += [MAGIC + bytes(rng.randrange(256) for _ in range(rng.randrange(200))) for _ in range(200)]
    candidates += [bytes(rng.randrange(256) for _ in range(rng.randrange(200))) for _ in range(50)]
    for candidate in candidates:
        path.write_bytes(candidate)
        assert _load_quietly(path, caplog).node_count == 0


def test_a_rejected_snapshot_is_kept_aside_and_the_next_save_does_not_touch_it(tmp_path, trie, caplog):
    path = tmp_path / "lookahead_0_0.trie"
    save_trie(trie, path, FINGERPRINT)
    corrupt = _corrupt_flip_a_column_byte(path.read_bytes())
    path.write_bytes(corrupt)
    with caplog.at_level(logging.ERROR, logger="lookahead"):
        loaded = load_trie(path, capacity=50_000, max_depth=8, fingerprint=FINGERPRINT)
    rejected = tmp_path / "lookahead_0_0.trie.rejected"
    assert f"moved to {rejected}" in caplog.text
    save_trie(loaded, path, FINGERPRINT)
    assert rejected.read_bytes() == corrupt
    assert load_trie(path, capacity=100, max_depth=8, fingerprint=FINGERPRINT).node_count == 0


def test_a_second_server_cannot_claim_a_snapshot_a_live_server_holds(tmp_path):
    path = tmp_path / "lookahead_0_0.trie"
    other = subprocess.Popen(["sleep", "60"])  # stands for another running tritonserver
    try:
        claim_snapshot(path, other.pid)
        claim_snapshot(path, other.pid)  # its own instances (and a reloaded one) share the claim
        with pytest.raises(SnapshotInUse, match=f"written by another running server \\(pid {other.pid}\\)"):
            claim_snapshot(path, os.getpid())
    finally:
        other.kill()
        other.wait()
    claim_snapshot(path, os.getpid())  # a dead server's claim is taken over
    assert (tmp_path / "lookahead_0_0.trie.lock").read_text() == str(os.getpid())
