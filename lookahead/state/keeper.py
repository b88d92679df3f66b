"""The instance's global trie outside the step loop: its snapshots and the fleet's stream.

The engine thread calls a `TrieKeeper` between steps only, so the trie never changes mid-step
and a snapshot never sees a half-applied step: `between_steps` inserts what other instances
published (a bounded amount per call) and saves a snapshot when one is due; `learned_from` queues
what a finished request taught the trie for publishing. Network work happens on the sync
thread (sync.py); `save_trie` writes atomically, so a crash mid-save keeps the previous file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from ..algorithm.trie import NGramTrie
from ..config import LookaheadConfig
from .persistence import save_trie
from .sync import HISTORY_WAIT_S, START, Log, TrieSync

APPLY_TOKENS_PER_STEP = 512  # received tokens inserted between two steps (whole entries); the rest wait
IDLE_POLL_S = 0.25  # how often an idle engine looks for received entries while syncing
HISTORY_POLL_S = 0.05  # how often a joining keeper inserts the history read so far


class Finished(Protocol):
    """What the keeper reads of a finished request (runtime.generation.Generation is one)."""

    ids: list[int]
    prompt_len: int
    finish_reason: str | None
    stop_tokens: frozenset[int]
    config: LookaheadConfig

    @property
    def output_ids(self) -> list[int]: ...


def learned_tokens(generation: Finished) -> list[int]:
    """What a request's writer fed the global trie: the prompt's last max_query_length - 1 tokens
    (the keys its outputs are found by) and the output, less a final stop token."""
    prompt = generation.ids[: generation.prompt_len]
    output = generation.output_ids
    if generation.finish_reason == "stop" and output and output[-1] in generation.stop_tokens:
        output = output[:-1]
    if not output:
        return []
    return prompt[max(0, len(prompt) - generation.config.max_query_length + 1) :] + output


class TrieKeeper:
    """Saves the global trie (at most once per interval when it changed, and when the engine
    stops) and, with a `TrieSync`, exchanges what it learns with the fleet."""

    def __init__(
        self,
        trie: NGramTrie,
        path: Path,
        fingerprint: str,
        interval_s: float,
        log: Log,
        stop_words: frozenset[int] = frozenset(),
        stream: dict | None = None,
    ):
        self.trie, self.path, self.fingerprint = trie, path, fingerprint
        self.interval_s, self.log = interval_s, log
        self.stop_words = stop_words
        self.stream = dict(stream or {})  # the snapshot's sync position: key, source, cursor
        self.sync: TrieSync | None = None
        self.changed = False
        self.last_save = time.monotonic()

    def resume_position(self, key: str) -> tuple[str | None, str]:
        """(source id, cursor) a sync of `key` resumes from: the snapshot's when it synced the same
        stream (its entries up to the cursor are in the trie), else a new source from the start."""
        if self.stream.get("key") == key and isinstance(self.stream.get("cursor"), str):
            return self.stream.get("source"), self.stream["cursor"]
        return None, START

    def join(self, sync: TrieSync, history_wait_s: float = HISTORY_WAIT_S) -> int:
        """Start syncing (before the engine starts): wait for the stream's retained entries and
        insert them all. Returns the number inserted; 0 when Redis is unreachable (the thread
        keeps trying, and the history arrives between steps once it answers)."""
        self.sync = sync
        self.stream = {"key": sync.key, "source": sync.source, "cursor": sync.cursor}
        sync.start()
        deadline = time.monotonic() + history_wait_s
        inserted = 0
        while not sync.caught_up.wait(HISTORY_POLL_S) and time.monotonic() < deadline:
            inserted += self._apply(None)  # reading pauses while too many tokens wait
        return inserted + self._apply(None)

    def mark_changed(self) -> None:
        self.changed = True

    def learned_from(self, generation: Finished) -> None:
        """Publish what the global trie learned from a request that ended (nothing when the
        request had `learn` off)."""
        if self.sync is not None and generation.config.learn:
            self.sync.publish(learned_tokens(generation))

    def between_steps(self) -> None:
        """Insert received entries, then save when a snapshot is due; a sync thread that died is
        started again (it cannot die of an entry: only of an error no thread should catch)."""
        if self.sync is not None:
            if not self.sync.alive:
                self.log.log_error("trie sync: the sync thread died; restarting it")
                self.sync.restart()
            self._apply(APPLY_TOKENS_PER_STEP)
        self.maybe_save()

    def idle_timeout(self) -> float | None:
        """How long an idle engine may wait before calling between_steps; None: until a request."""
        waits = []
        if self.sync is not None:
            waits.append(IDLE_POLL_S)
        if self.changed and self.interval_s > 0:
            waits.append(max(0.01, self.last_save + self.interval_s - time.monotonic()))
        return min(waits) if waits else None

    def maybe_save(self) -> None:
        if self.interval_s > 0 and self.changed and time.monotonic() - self.last_save >= self.interval_s:
            self.save()

    def save(self) -> None:
        """Write now, changed or not: on unload every instance leaves its file behind."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_trie(self.trie, self.path, self.fingerprint, self.stream or None)
        except OSError as error:  # a full disk must not take the instance down; retry next interval
            self.log.log_error(f"Could not save the trie snapshot {self.path}: {error}")
        else:
            self.changed = False
        self.last_save = time.monotonic()

    def close(self) -> None:
        """Stop syncing, then take the last snapshot (engine thread, after the last step)."""
        if self.sync is not None:
            self.sync.stop()
            self._apply(None)
        self.save()

    def _apply(self, max_tokens: int | None) -> int:
        """Insert received entries; the snapshot's position moves past them and past the entries
        skipped after them (rejected ones included), never past one still waiting."""
        entries = self.sync.take(max_tokens)
        for entry in entries:
            self.trie.writer().feed(entry.tokens, self.stop_words)
        if self.stream.get("cursor") != self.sync.taken_through:
            self.stream["cursor"] = self.sync.taken_through
            self.changed = True
        return len(entries)
