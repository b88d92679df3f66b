"""Trie snapshot files: versioned, checksummed, written atomically, never unpickled.

Layout, little-endian:

    MAGIC (8 bytes) | format version (u32) | header length (u32) | header (UTF-8 JSON)
    | the trie.STORED columns of nodes 0..node_count, one after another | sha256 of all the above

The header names the model/tokenizer identity (`fingerprint`), `max_depth`, `node_count` and the
columns with their dtypes; with fleet sync on, also `stream`: the instance's place in its Redis
stream (sync.py), so that a restart resumes there instead of inserting the history twice.
Token ids mean nothing under another tokenizer, so a snapshot from another model is refused. A
server must come up even when its snapshot is unusable, so loading never raises on a bad file:
it logs why, naming the file, moves the file aside to `<name>.rejected` (so the next save does
not destroy the evidence) and starts with an empty trie.

`claim_snapshot` keeps two servers from sharing one snapshot: each would overwrite the other's
file at every save.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..algorithm.trie import STORED, NGramTrie

MAGIC = b"LATRIE\r\n"  # the CR LF catches text-mode transfers
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<II")  # format version, header length
_DIGEST_BYTES = hashlib.sha256().digest_size

logger = logging.getLogger("lookahead")


class SnapshotError(ValueError):
    """Why a snapshot file cannot be used."""


@dataclass
class Snapshot:
    """A loaded snapshot: the trie and the header's `stream` entry ({} when absent)."""

    trie: NGramTrie
    stream: dict[str, Any] = field(default_factory=dict)


class SnapshotInUse(RuntimeError):
    """Another running server writes this snapshot."""


def _disk_dtype(dtype: type) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def save_trie(
    trie: NGramTrie, path: str | os.PathLike[str], fingerprint: str, stream: dict[str, Any] | None = None
) -> None:
    """Write a snapshot of `trie` to `path`, replacing it atomically (a reader never sees half a file).

    `stream`: JSON-able sync position stored in the header. Raises OSError when the folder cannot
    be written.
    """
    path = Path(path)
    columns = trie.to_columns()
    header = {
        "fingerprint": fingerprint,
        "max_depth": trie.max_depth,
        "node_count": trie.node_count,
        "columns": [[name, _disk_dtype(dtype).str] for name, (_, dtype) in STORED.items()],
    }
    if stream:
        header["stream"] = stream
    header_bytes = json.dumps(header, sort_keys=True).encode()
    parts = [MAGIC, _PREAMBLE.pack(FORMAT_VERSION, len(header_bytes)), header_bytes]
    parts += [columns[name].astype(_disk_dtype(dtype)).tobytes() for name, (_, dtype) in STORED.items()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.writelines(parts)
            file.write(digest.digest())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def load_trie(
    path: str | os.PathLike[str],
    *,
    capacity: int,
    max_depth: int,
    fingerprint: str,
    vocab_size: int | None = None,
) -> NGramTrie:
    """The trie saved at `path`, evicted down to `capacity` if needed; an empty trie when the file
    is missing (logged at info) or unusable (logged as an error with the reason), which includes
    holding token ids at or above `vocab_size`."""
    return load_snapshot(
        path, capacity=capacity, max_depth=max_depth, fingerprint=fingerprint, vocab_size=vocab_size
    ).trie


def load_snapshot(
    path: str | os.PathLike[str],
    *,
    capacity: int,
    max_depth: int,
    fingerprint: str,
    vocab_size: int | None = None,
) -> Snapshot:
    """load_trie's trie with the header's sync position; an empty one where load_trie's is empty."""
    path = Path(path)
    empty = Snapshot(NGramTrie(capacity=capacity, max_depth=max_depth))  # raises on a bad configuration
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        logger.info("No trie snapshot at %s; starting with an empty trie", path)
        return empty
    except OSError as error:
        logger.error("Cannot read trie snapshot %s: %s; starting with an empty trie", path, error)
        return empty
    try:
        snapshot = _decode(
            data, capacity=capacity, max_depth=max_depth, fingerprint=fingerprint, vocab_size=vocab_size
        )
    except Exception as error:  # SnapshotError, or whatever else a crafted file provokes
        reason = error if isinstance(error, SnapshotError) else f"undecodable ({type(error).__name__})"
        rejected = path.with_name(path.name + ".rejected")
        try:
            os.replace(path, rejected)
        except OSError as move_error:
            kept = f"could not move it aside ({move_error})"
        else:
            kept = f"moved to {rejected}"
        logger.error("Ignoring trie snapshot %s: %s; %s; starting with an empty trie", path, reason, kept)
        return empty
    logger.info("Loaded trie snapshot %s: %d nodes (capacity %d)", path, snapshot.trie.node_count, capacity)
    return snapshot


def _decode(
    data: bytes, *, capacity: int, max_depth: int, fingerprint: str, vocab_size: int | None
) -> Snapshot:
    start = len(MAGIC) + _PREAMBLE.size
    if data[: len(MAGIC)] != MAGIC:
        raise SnapshotError("not a trie snapshot (bad magic bytes)")
    if len(data) < start:
        raise SnapshotError(f"truncated file: {len(data)} bytes")
    version, header_length = _PREAMBLE.unpack_from(data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise SnapshotError(
            f"unsupported format version {version} (this build reads version {FORMAT_VERSION})"
        )
    try:
        header = json.loads(data[start : start + header_length])
    except ValueError as error:
        raise SnapshotError(f"unreadable header ({error})") from None
    node_count = header.get("node_count") if isinstance(header, dict) else None
    if type(node_count) is not int or node_count < 0:
        raise SnapshotError(f"unreadable header (node_count {node_count!r} is not a count)")
    column_bytes = [(node_count + 1) * _disk_dtype(dtype).itemsize for _, dtype in STORED.values()]
    expected = start + header_length + sum(column_bytes) + _DIGEST_BYTES
    if len(data) != expected:
        raise SnapshotError(f"truncated or padded file: {len(data)} bytes, expected {expected}")
    if hashlib.sha256(data[:-_DIGEST_BYTES]).digest() != data[-_DIGEST_BYTES:]:
        raise SnapshotError("checksum mismatch (the file is corrupt)")
    if header.get("fingerprint") != fingerprint:
        raise SnapshotError(
            f"fingerprint {header.get('fingerprint')!r} does not match {fingerprint!r} "
            "(saved for another model or tokenizer)"
        )
    if header.get("max_depth") != max_depth:
        raise SnapshotError(f"max_depth {header.get('max_depth')} does not match the configured {max_depth}")
    expected_columns = [[name, _disk_dtype(dtype).str] for name, (_, dtype) in STORED.items()]
    if header.get("columns") != expected_columns:
        raise SnapshotError(f"columns {header.get('columns')} differ from {expected_columns}")
    columns, offset = {}, start + header_length
    for (name, (_, dtype)), size in zip(STORED.items(), column_bytes, strict=True):
        columns[name] = np.frombuffer(data, dtype=_disk_dtype(dtype), count=node_count + 1, offset=offset)
        offset += size
    if vocab_size is not None and node_count and int(columns["token"][1:].max()) >= vocab_size:
        raise SnapshotError(f"token ids outside the model's vocabulary (size {vocab_size})")
    try:
        trie = NGramTrie.from_columns(columns, capacity=capacity, max_depth=max_depth)
    except ValueError as error:
        raise SnapshotError(f"inconsistent trie ({error})") from None
    stream = header.get("stream")
    return Snapshot(trie, stream if isinstance(stream, dict) else {})


def claim_snapshot(path: str | os.PathLike[str], server_pid: int) -> None:
    """Record that the server process `server_pid` writes the snapshot at `path` (in `<name>.lock`).

    Raises SnapshotInUse when another live server holds it. The instances of one server share the
    claim: a reloaded instance starts before the one it replaces has finalized. A dead holder's
    claim is taken over.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two servers starting together take turns here
        lock.seek(0)
        holder = lock.read().strip()
        if holder.isdigit() and int(holder) != server_pid and _alive(int(holder)):
            raise SnapshotInUse(
                f"trie snapshot {path} is written by another running server (pid {holder}); "
                "give each server its own trie_state_dir"
            )
        lock.seek(0)
        lock.truncate()
        lock.write(str(server_pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
