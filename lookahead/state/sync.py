"""Fleet-wide learning through one Redis stream per model identity.

Every instance appends what its global trie learned from a request (one token sequence per
entry) to the stream `<namespace>:trie:<fingerprint>` and inserts what the others append, so
replicas of one model draft from everything the fleet has generated. The fingerprint in the key
keeps models and tokenizers apart; XADD's MAXLEN bounds the stream, so Redis memory stays
bounded however long the fleet runs, and the retained entries warm up an instance that starts.

An entry's fields (all ASCII, readable with redis-cli XRANGE):

    v    the format version, FORMAT_VERSION
    src  the publishing instance's source id (an instance skips its own entries)
    ids  the token ids, decimal, comma-separated

`TrieSync` does all network work on a thread of its own: the engine thread only appends to an
outbox and drains an inbox, so a slow or dead Redis never delays a step. Connection trouble is
logged once per outage; the thread reconnects with backoff and publishes what waited meanwhile.
Anyone who can write to the stream can write anything: every entry that is not one this build
can insert is counted and skipped, and reading pauses while more tokens wait in the inbox than
MAX_WAITING_TOKENS (the engine inserts APPLY_TOKENS_PER_STEP per step).
"""

from __future__ import annotations

import re
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import redis

FORMAT_VERSION = "1"
SCHEMES = ("redis", "rediss")
START = "0-0"  # the stream position before its first entry
READ_BATCH = 512  # entries per XREAD
PUBLISH_BATCH = 64  # entries per pipelined round trip
BLOCK_MS = 100  # how long one XREAD waits for news; also how late a queued entry is published
SOCKET_TIMEOUT_S = 2.0  # a Redis slower than this counts as down
BACKOFF_S = (0.25, 8.0)  # first and longest wait between reconnection attempts
OUTBOX_LIMIT = 4096  # entries waiting for Redis; beyond, new ones are learned locally only
HISTORY_WAIT_S = 10.0  # most time a starting instance waits for the stream's retained entries
# Received tokens waiting for the engine beyond which reading pauses (raised to four of the
# largest entries where those are larger).
MAX_WAITING_TOKENS = 65_536
# The longest entry accepted from a model with no context length in its config (for the others:
# the context length, see entry_token_bound).
MAX_ENTRY_TOKENS = 131_072

COUNTS = ("published", "received", "rejected", "reconnects")


class Log(Protocol):
    def log_info(self, message: str) -> None: ...

    def log_warn(self, message: str) -> None: ...

    def log_error(self, message: str) -> None: ...


class EntryError(ValueError):
    """Why a stream entry is not inserted; `kind` groups reasons so that each is logged once."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def check_url(url: str) -> str:
    """`url` if it names a Redis server (redis:// or rediss://, host, optional port, password, db)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"expected a redis:// or rediss:// URL, got {redacted(url)!r}")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise ValueError(f"bad port in {redacted(url)!r}") from None
    if not parts.hostname:
        raise ValueError(f"no host in {redacted(url)!r}")
    database = parts.path.strip("/")
    if database and not database.isdigit():
        raise ValueError(f"the database must be a number, got {database!r}")
    return url


def redacted(url: str) -> str:
    """The URL without its password, for logs and messages."""
    return re.sub(r"^([a-z]+://[^:/@]*:)[^@]*@", r"\1***@", url)


def stream_key(namespace: str, fingerprint: str) -> str:
    return f"{namespace}:trie:{fingerprint}"


def new_source() -> str:
    return uuid.uuid4().hex


def encode_entry(tokens: Sequence[int], source: str) -> dict[str, str]:
    return {"v": FORMAT_VERSION, "src": source, "ids": ",".join(map(str, tokens))}


def entry_token_bound(context_length: int | None) -> int:
    """The most tokens an honest peer publishes: a request's prompt tail and output
    (keeper.learned_tokens), which its context holds. Every replica of one stream serves the same
    model (the fingerprint is in the key), so its context length bounds every peer's entries,
    whatever their max_prompt_tokens and max_output_tokens."""
    return context_length if context_length else MAX_ENTRY_TOKENS


def decode_entry(fields: Mapping[bytes, bytes], *, vocab_size: int, max_tokens: int) -> tuple[str, list[int]]:
    """(source, token ids) of a stream entry; EntryError when it is not one this instance can insert."""
    version = fields.get(b"v")
    if version != FORMAT_VERSION.encode():
        raise EntryError("version", f"format version {version!r} (this build reads {FORMAT_VERSION})")
    source, raw = fields.get(b"src"), fields.get(b"ids")
    if source is None or raw is None:
        raise EntryError("fields", f"missing 'src' or 'ids' (fields {sorted(fields)})")
    if len(raw) > max_tokens * 11:  # 10 digits and a comma per id at most: refused before parsing
        raise EntryError("size", f"{len(raw)} bytes of ids, more than {max_tokens} tokens can take")
    parts = raw.split(b",") if raw else []
    if not all(part.isdigit() for part in parts):
        raise EntryError("ids", "ids are not comma-separated non-negative integers")
    if len(parts) > max_tokens:
        raise EntryError("size", f"{len(parts)} tokens, more than {max_tokens}")
    digits = len(str(vocab_size))
    too_long = next((part for part in parts if len(part.lstrip(b"0")) > digits), None)
    if too_long is not None:  # refused before int(), which refuses more than 4300 digits
        message = f"a token id of {len(too_long)} digits, outside the vocabulary (size {vocab_size})"
        raise EntryError("ids", message)
    tokens = [int(part) for part in parts]
    if tokens and max(tokens) >= vocab_size:
        raise EntryError("ids", f"token id {max(tokens)} outside the vocabulary (size {vocab_size})")
    return source.decode(errors="replace"), tokens


@dataclass(frozen=True)
class Received:
    """Another instance's entry: its stream id (the position to resume after) and its tokens."""

    entry_id: str
    tokens: list[int]


class TrieSync:
    """The thread that publishes this instance's entries and collects the others'.

    `publish` and `take` are the engine thread's whole interface; neither waits on the network.
    `cursor` is the id of the last entry read: the stream is read from there on (also after a
    reconnection), so an entry is received at most once.
    """

    def __init__(
        self,
        url: str,
        key: str,
        *,
        vocab_size: int,
        max_tokens: int,
        max_entries: int,
        log: Log,
        on_count: Callable[[str, int], None] | None = None,
        source: str | None = None,
        cursor: str = START,
        max_waiting_tokens: int = MAX_WAITING_TOKENS,
    ):
        self.url, self.key = check_url(url), key
        self.vocab_size, self.max_tokens, self.max_entries = vocab_size, max_tokens, max_entries
        self.max_waiting_tokens = max(max_waiting_tokens, 4 * max_tokens)
        self.log = log
        self.on_count = on_count
        self.source = source or new_source()
        self.cursor = cursor
        self.outbox: deque[list[int]] = deque()  # appended by the engine thread, sent by this one
        self.inbox: deque[Received] = deque()  # appended by this thread, drained by the engine thread
        self.waiting_tokens = 0  # the inbox's tokens
        # Stream id through which every entry read is in the inbox or was skipped (rejected, its
        # own); taken_through: through which every entry was taken or skipped (engine thread).
        self.read_through = self.taken_through = cursor
        self._inbox_lock = threading.Lock()
        self.caught_up = threading.Event()  # the retained history was read, or Redis was unreachable
        self.counts = dict.fromkeys(COUNTS, 0)
        self._stopping = threading.Event()
        self._down = False  # in an outage (logged once)
        self._connected_once = False
        self._outbox_full_logged = False
        self._logged_kinds: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="lookahead-trie-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def restart(self) -> None:
        """A new thread in place of one that died, reading on from the cursor."""
        self._thread = threading.Thread(target=self._run, name="lookahead-trie-sync", daemon=True)
        self._thread.start()

    def wait_for_history(self, timeout_s: float = HISTORY_WAIT_S) -> bool:
        """Block until the retained entries are in the inbox (True) or Redis proved unreachable."""
        return self.caught_up.wait(timeout_s) and not self._down

    def stop(self) -> None:
        """End the thread; entries still in the outbox are sent first when Redis answers at once."""
        self._stopping.set()
        self._thread.join()

    def publish(self, tokens: Sequence[int]) -> None:
        """Queue one learned sequence (engine thread; never blocks)."""
        if not tokens:
            return
        if len(self.outbox) >= OUTBOX_LIMIT:
            if not self._outbox_full_logged:
                self._outbox_full_logged = True
                self.log.log_warn(
                    f"trie sync: {OUTBOX_LIMIT} entries wait for Redis; newer ones are learned locally only"
                )
            return
        self.outbox.append(list(tokens))

    def take(self, max_tokens: int | None = None) -> list[Received]:
        """Received entries in stream order, up to about max_tokens tokens (engine thread); sets
        taken_through."""
        taken, budget = [], max_tokens
        with self._inbox_lock:
            while self.inbox and (budget is None or budget > 0):
                entry = self.inbox.popleft()
                taken.append(entry)
                self.waiting_tokens -= len(entry.tokens)
                if budget is not None:
                    budget -= max(1, len(entry.tokens))
            self.taken_through = taken[-1].entry_id if self.inbox else self.read_through
        return taken

    def _count(self, kind: str, n: int = 1) -> None:
        if n:
            self.counts[kind] += n
            if self.on_count is not None:
                self.on_count(kind, n)

    def _run(self) -> None:
        delay = BACKOFF_S[0]
        while not self._stopping.is_set():
            client = redis.Redis.from_url(
                self.url,
                socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=SOCKET_TIMEOUT_S,
                retry_on_timeout=False,
                retry=None,
                protocol=2,
            )
            try:
                client.ping()
                self._on_connected()
                delay = BACKOFF_S[0]
                self._serve(client)
            except (redis.RedisError, OSError) as error:
                self._on_failure(error)
                self._stopping.wait(delay)
                delay = min(delay * 2, BACKOFF_S[1])
            except Exception as error:  # a bug must not end fleet learning: log it, start over
                self.log.log_error(
                    f"trie sync: unexpected {type(error).__name__} ({error}); reconnecting with backoff"
                )
                self._stopping.wait(delay)
                delay = min(delay * 2, BACKOFF_S[1])
            finally:
                client.close()

    def _on_connected(self) -> None:
        if self._down:
            self._down = False
            self._count("reconnects")
            self.log.log_info(f"trie sync: reconnected to {redacted(self.url)}; publishing again")
        elif not self._connected_once:
            self.log.log_info(f"trie sync: connected to {redacted(self.url)}, stream {self.key}")
        self._connected_once = True

    def _on_failure(self, error: BaseException) -> None:
        if not self._down:
            self._down = True
            self.log.log_warn(
                f"trie sync: Redis at {redacted(self.url)} failed ({type(error).__name__}: {error}); "
                "learning locally, reconnecting with backoff"
            )
        self.caught_up.set()  # a starting instance waits no longer

    def _serve(self, client: redis.Redis) -> None:
        """Publish and read until stopped or the connection fails. Reads without blocking until
        the stream's end (the history), then waits up to BLOCK_MS per read."""
        while True:
            self._flush(client)
            if self._stopping.is_set():
                return
            room = self.max_waiting_tokens - self.waiting_tokens
            if room < self.max_tokens:  # the engine has not inserted what waits: read later
                self._stopping.wait(BLOCK_MS / 1000)
                continue
            count = min(READ_BATCH, room // self.max_tokens)
            block = BLOCK_MS if self.caught_up.is_set() else None
            reply = client.xread({self.key: self.cursor}, count=count, block=block)
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                self._accept(entry_id.decode(), fields)
            if len(entries) < count:
                self.caught_up.set()

    def _flush(self, client: redis.Redis) -> None:
        """Send the outbox; an entry leaves it only once Redis has it."""
        while self.outbox:
            batch = [self.outbox[i] for i in range(min(PUBLISH_BATCH, len(self.outbox)))]
            pipeline = client.pipeline(transaction=False)
            for tokens in batch:
                pipeline.xadd(
                    self.key, encode_entry(tokens, self.source), maxlen=self.max_entries, approximate=True
                )
            pipeline.execute()
            for _ in batch:
                self.outbox.popleft()
            self._count("published", len(batch))

    def _accept(self, entry_id: str, fields: dict[Any, Any]) -> None:
        """Queue one entry for the engine, or count and skip it; nothing in an entry raises here."""
        self.cursor = entry_id
        received = None
        try:
            source, tokens = decode_entry(fields, vocab_size=self.vocab_size, max_tokens=self.max_tokens)
            if source != self.source:  # its own entries are in its trie already
                received = Received(entry_id, tokens)
        except Exception as error:
            kind = error.kind if isinstance(error, EntryError) else type(error).__name__
            self._count("rejected")
            if kind not in self._logged_kinds:
                self._logged_kinds.add(kind)
                self.log.log_warn(
                    f"trie sync: rejected entry {entry_id} of {self.key}: {str(error)[:200]} "
                    "(further rejections of this kind are only counted)"
                )
        with self._inbox_lock:
            if received is not None:
                self.inbox.append(received)
                self.waiting_tokens += len(received.tokens)
            self.read_through = entry_id
        if received is not None:
            self._count("received")
