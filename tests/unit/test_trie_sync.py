"""The fleet's trie stream: the entry codec, the sync thread against a real redis-server, the keeper."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from backend.config import parse_parameters
from backend.request import DictInputs, GenerationRequest, RequestError, RequestLimits, parse_request
from bench.local_redis import RedisServer
from lookahead.algorithm.trie import NGramTrie
from lookahead.config import LookaheadConfig, SamplingParams
from lookahead.contract import SYNC_ENV
from lookahead.runtime.decoder import LookaheadDecoder
from lookahead.state.keeper import TrieKeeper, learned_tokens
from lookahead.state.persistence import load_snapshot
from lookahead.state.sync import (
    FORMAT_VERSION,
    START,
    EntryError,
    TrieSync,
    check_url,
    decode_entry,
    encode_entry,
    entry_token_bound,
    redacted,
)
from tests.helpers import wait_until
from tests.redis_server import require_redis_server, running_redis

KEY = "test:trie:fp"
VOCAB = 1000


class Log:
    def __init__(self):
        self.lines: list[str] = []

    def log_info(self, message: str) -> None:
        self.lines.append(f"I {message}")

    def log_warn(self, message: str) -> None:
        self.lines.append(f"W {message}")

    def log_error(self, message: str) -> None:
        self.lines.append(f"E {message}")

    def warnings(self, text: str) -> list[str]:
        return [line for line in self.lines if line.startswith("W") and text in line]


def as_fields(entry: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in entry.items()}


def make_sync(url: str, log: Log, **kwargs) -> TrieSync:
    options = dict(vocab_size=VOCAB, max_tokens=100, max_entries=1000, log=log)
    return TrieSync(url, KEY, **{**options, **kwargs})


def received_tokens(sync: TrieSync) -> list[list[int]]:
    return [entry.tokens for entry in sync.take()]


# The entry codec


def test_an_entry_decodes_to_its_source_and_tokens() -> None:
    entry = encode_entry([5, 0, 999], "abc")
    assert entry == {"v": FORMAT_VERSION, "src": "abc", "ids": "5,0,999"}
    assert decode_entry(as_fields(entry), vocab_size=VOCAB, max_tokens=3) == ("abc", [5, 0, 999])


@pytest.mark.parametrize(
    ("fields", "kind", "message"),
    [
        ({b"v": b"2", b"src": b"a", b"ids": b"1"}, "version", "format version b'2'"),
        ({b"src": b"a", b"ids": b"1"}, "version", "format version None"),
        ({b"v": b"1", b"ids": b"1"}, "fields", "missing 'src' or 'ids'"),
        ({b"v": b"1", b"src": b"a", b"ids": b"1,x,3"}, "ids", "not comma-separated"),
        ({b"v": b"1", b"src": b"a", b"ids": b"1,-3"}, "ids", "not comma-separated"),
        ({b"v": b"1", b"src": b"a", b"ids": b"1,1000"}, "ids", "token id 1000 outside the vocabulary"),
        ({b"v": b"1", b"src": b"a", b"ids": b"1,2,3,4,5"}, "size", "5 tokens, more than 4"),
        ({b"v": b"1", b"src": b"a", b"ids": b"1" * 100}, "size", "100 bytes of ids"),
    ],
)
def test_a_bad_entry_is_refused_with_its_reason(fields, kind: str, message: str) -> None:
    with pytest.raises(EntryError, match=message.replace("(", r"\(")) as error:
        decode_entry(fields, vocab_size=VOCAB, max_tokens=4)
    assert error.value.kind == kind


def test_urls_are_checked_and_passwords_never_shown() -> None:
    assert check_url("rediss://:secret@cache.example:6380/2") == "rediss://:secret@cache.example:6380/2"
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("redis://host:6379") == "redis://host:6379"
    for bad, reason in [
        ("http://host:6379", "redis:// or rediss://"),
        ("redis://:secret@host:port", "bad port"),
        ("redis://:secret@/0", "no host"),
        ("redis://host/x", "database must be a number"),
    ]:
        with pytest.raises(ValueError, match=reason) as error:
            check_url(bad)
        assert "secret" not in str(error.value)


# The sync thread against a real redis-server


def test_instances_receive_each_others_entries_never_their_own(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server:
        log_a, log_b = Log(), Log()
        a, b = make_sync(server.url, log_a), make_sync(server.url, log_b)
        a.start(), b.start()
        try:
            assert a.wait_for_history() and b.wait_for_history()
            started = time.monotonic()
            a.publish([1, 2, 3])
            b.publish([7, 8])
            assert wait_until(lambda: len(a.inbox) == 1 and len(b.inbox) == 1)
            assert time.monotonic() - started < 1.0
            assert received_tokens(b) == [[1, 2, 3]] and received_tokens(a) == [[7, 8]]
            time.sleep(0.3)  # a second look: nothing echoes back
            assert not a.inbox and not b.inbox
            assert a.counts == {"published": 1, "received": 1, "rejected": 0, "reconnects": 0}
            assert server.client().xlen(KEY) == 2
        finally:
            a.stop(), b.stop()


def test_a_late_instance_reads_the_retained_history_and_the_stream_stays_bounded(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server:
        writer = make_sync(server.url, Log(), max_entries=100)
        writer.start()
        for i in range(1000):
            writer.publish([i % VOCAB, 1, 2])
        assert wait_until(lambda: writer.counts["published"] == 1000)
        writer.stop()
        length = server.client().xlen(KEY)
        assert 100 <= length < 300  # MAXLEN ~ 100: Redis trims whole macro nodes
        late = make_sync(server.url, Log())
        late.start()
        try:
            assert late.wait_for_history()
            history = received_tokens(late)  # all in the inbox before wait_for_history returned
            assert len(history) == length
            assert history[-1] == [999, 1, 2]
        finally:
            late.stop()


def test_a_resumed_sync_reads_only_what_follows_its_cursor(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server:
        client = server.client()
        first = client.xadd(KEY, encode_entry([1], "other")).decode()
        client.xadd(KEY, encode_entry([2], "other"))
        client.xadd(KEY, encode_entry([3], "mine"))
        sync = make_sync(server.url, Log(), source="mine", cursor=first)
        sync.start()
        try:
            assert sync.wait_for_history()
            assert received_tokens(sync) == [[2]]  # [1] is behind the cursor, [3] its own
        finally:
            sync.stop()


def test_garbage_in_the_stream_is_counted_and_logged_once_per_kind(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server:
        client = server.client()
        garbage = [
            {"v": "1", "src": "x", "ids": "1,two,3"},
            {"v": "1", "src": "x", "ids": "1,2,99999"},
            {"v": "1", "src": "x", "ids": ",".join(["5"] * 5000)},
            {"v": "9", "src": "x", "ids": "1,2"},
            {"v": "9", "src": "x", "ids": "1,2"},
            {"hello": "world"},
        ]
        for fields in garbage:
            client.xadd(KEY, fields)
        client.xadd(KEY, encode_entry([4, 5, 6], "x"))
        log = Log()
        sync = make_sync(server.url, log)
        sync.start()
        try:
            assert sync.wait_for_history()
            assert received_tokens(sync) == [[4, 5, 6]]
            assert sync.counts["rejected"] == 6
            rejected = log.warnings("rejected entry")
            assert len(rejected) == 3  # ids, size, version: each kind logged once
            assert "not comma-separated" in rejected[0]
            assert "more than 100 tokens" in rejected[1]
            assert "format version b'9'" in rejected[2]
        finally:
            sync.stop()


def test_redis_down_at_start_then_up_publishes_what_waited(tmp_path: Path) -> None:
    require_redis_server()
    server = RedisServer(tmp_path)
    log = Log()
    sync = make_sync(server.url, log)
    sync.start()
    try:
        started = time.monotonic()
        assert not sync.wait_for_history()  # unreachable: the instance starts cold, at once
        assert time.monotonic() - started < 5
        sync.publish([9, 9, 9])
        time.sleep(1.0)  # a few failed attempts
        assert len(log.warnings("failed")) == 1
        server.start()
        assert wait_until(lambda: sync.counts["published"] == 1, 20)
        assert sync.counts["reconnects"] == 1
        entries = server.client().xrange(KEY)
        assert [e[1][b"ids"] for e in entries] == [b"9,9,9"]
        assert any("reconnected" in line for line in log.lines)
    finally:
        sync.stop()
        server.kill()


def test_redis_killed_mid_stream_and_restarted_empty_loses_no_later_entry(tmp_path: Path) -> None:
    require_redis_server()
    server = RedisServer(tmp_path).start()
    log_a, log_b = Log(), Log()
    a, b = make_sync(server.url, log_a), make_sync(server.url, log_b)
    a.start(), b.start()
    try:
        a.publish([1, 1])
        assert wait_until(lambda: len(b.inbox) == 1)
        server.kill()
        a.publish([2, 2])  # learned while Redis is down: waits in the outbox
        assert wait_until(lambda: log_a.warnings("failed") and log_b.warnings("failed"))
        server.start()  # the same port, no data
        assert wait_until(lambda: len(b.inbox) == 2, 30)
        assert received_tokens(b) == [[1, 1], [2, 2]]
        a.publish([3, 3])
        assert wait_until(lambda: len(b.inbox) == 1)
        assert received_tokens(b) == [[3, 3]]
        assert len(log_a.warnings("failed")) == 1 and a.counts["reconnects"] == 1
    finally:
        a.stop(), b.stop()
        server.kill()


def test_a_hung_redis_never_blocks_publish_and_recovers(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server:
        log = Log()
        a, b = make_sync(server.url, log), make_sync(server.url, Log())
        a.start(), b.start()
        try:
            assert a.wait_for_history() and b.wait_for_history()
            server.pause()
            started = time.monotonic()
            for i in range(100):
                a.publish([i])
            assert time.monotonic() - started < 0.05
            assert wait_until(lambda: log.warnings("failed"), 10)
            server.resume()
            assert wait_until(lambda: len(b.inbox) == 100, 30)
            assert [t for e in b.take() for t in e.tokens] == list(range(100))
        finally:
            server.resume()
            a.stop(), b.stop()


# The keeper: the trie between steps


def ngrams(trie: NGramTrie) -> dict[tuple[int, ...], float]:
    """Every n-gram the trie holds, with its count."""
    found, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child, count in trie.children(node, 1 << 30):
            found[(*path, token)] = count
            stack.append((child, (*path, token)))
    return found


def test_the_keeper_inserts_history_at_join_and_news_between_steps(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as server:
        client = server.client()
        client.xadd(KEY, encode_entry([1, 2, 3, 4], "other"))
        trie = NGramTrie(capacity=1000, max_depth=4)
        keeper = TrieKeeper(trie, tmp_path / "t.trie", "fp", interval_s=0, log=Log())
        assert keeper.join(make_sync(server.url, Log())) == 1
        expected = NGramTrie(capacity=1000, max_depth=4)
        expected.insert([1, 2, 3, 4])
        assert trie.node_count == expected.node_count == 10
        last = client.xadd(KEY, encode_entry([5, 6], "other")).decode()
        assert wait_until(lambda: len(keeper.sync.inbox) == 1)
        keeper.between_steps()
        assert trie.node_count == 13 and keeper.stream["cursor"] == last
        keeper.close()
        saved = load_snapshot(tmp_path / "t.trie", capacity=1000, max_depth=4, fingerprint="fp")
        assert saved.trie.node_count == 13
        assert saved.stream == {"key": KEY, "source": keeper.sync.source, "cursor": last}


def test_a_restarted_keeper_resumes_without_inserting_anything_twice(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as server:
        client = server.client()
        for tokens in ([1, 2, 3], [4, 5, 6]):
            client.xadd(KEY, encode_entry(tokens, "other"))
        path = tmp_path / "t.trie"
        first = TrieKeeper(NGramTrie(capacity=1000, max_depth=4), path, "fp", interval_s=0, log=Log())
        first.join(make_sync(server.url, Log()))
        first.sync.publish([7, 8, 9])  # its own entry, already in its trie
        assert wait_until(lambda: first.sync.counts["published"] == 1)
        first.close()
        client.xadd(KEY, encode_entry([10, 11], "other"))  # arrives while it is down

        snapshot = load_snapshot(path, capacity=1000, max_depth=4, fingerprint="fp")
        before = snapshot.trie.node_count
        second = TrieKeeper(snapshot.trie, path, "fp", interval_s=0, log=Log(), stream=snapshot.stream)
        source, cursor = second.resume_position(KEY)
        assert source == first.sync.source and cursor != START
        assert second.join(make_sync(server.url, Log(), source=source, cursor=cursor)) == 1
        assert snapshot.trie.node_count == before + 3  # only [10, 11]: 10, 11, 10-11
        assert second.resume_position("another:key")[1] == START
        second.close()


def test_between_steps_inserts_a_bounded_amount(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as server:
        trie = NGramTrie(capacity=100_000, max_depth=4)
        keeper = TrieKeeper(trie, tmp_path / "t.trie", "fp", interval_s=0, log=Log())
        keeper.join(make_sync(server.url, Log(), max_tokens=1000))
        client = server.client()
        for i in range(5):
            client.xadd(KEY, encode_entry([(i + j) % VOCAB for j in range(1000)], "other"))
        assert wait_until(lambda: len(keeper.sync.inbox) == 5)
        keeper.between_steps()
        assert len(keeper.sync.inbox) == 4  # whole entries until 512 tokens are reached: one of 1000
        for _ in range(4):
            keeper.between_steps()
        assert not keeper.sync.inbox
        keeper.close()


# What a request teaches the global trie is what gets published


@pytest.mark.parametrize("learn", [True, False])
def test_the_published_tokens_are_what_the_global_trie_learned(
    learn: bool, tiny_model, byte_tokenizer
) -> None:
    model = tiny_model("llama")
    trie = NGramTrie(capacity=10_000, max_depth=6)
    config = LookaheadConfig(decoding_length=8, branch_length=4, adaptive=False, learn=learn)
    decoder = LookaheadDecoder(model, byte_tokenizer, trie, config)
    prompt = [10, 20, 30, 40, 50, 60, 10, 20, 30]
    generation = decoder.start(prompt, SamplingParams(max_tokens=24, ignore_eos=True), config)
    while not generation.finished:
        generation.step()
    if not learn:
        assert trie.node_count == 0  # private: the instance's trie learned nothing
        return
    published = learned_tokens(generation)
    assert published == prompt[-3:] + generation.output_ids
    replica = NGramTrie(capacity=10_000, max_depth=6)
    replica.writer().feed(published)
    assert ngrams(replica) == ngrams(trie) and len(ngrams(trie)) == trie.node_count


# Configuration: the parameters, the environment variable, the per-request key


def parse_config(tmp_path: Path, parameters: dict[str, str]):
    return parse_parameters(parameters, model_dir=tmp_path / "repo" / "lookahead", model_name="lookahead")


def test_trie_sync_is_off_by_default_and_lookahead_trie_sync_replaces_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(SYNC_ENV, raising=False)
    assert parse_config(tmp_path, {}).trie_sync == ""
    config = parse_config(tmp_path, {"trie_sync": "redis://a:1/0", "trie_sync_max_entries": "50"})
    assert (config.trie_sync, config.trie_sync_max_entries) == ("redis://a:1/0", 50)
    monkeypatch.setenv(SYNC_ENV, "rediss://:pw@fleet:6380/3")
    assert parse_config(tmp_path, {"trie_sync": "redis://a:1/0"}).trie_sync == "rediss://:pw@fleet:6380/3"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"trie_sync": "localhost:6379"}, "'trie_sync': expected a redis:// or rediss:// URL"),
        ({"trie_sync_namespace": "a b"}, "'trie_sync_namespace': expected letters"),
        ({"trie_sync_max_entries": "0"}, "'trie_sync_max_entries': must be >= 1"),
        ({"learn": "sometimes"}, "'learn': expected true or false"),
    ],
)
def test_bad_sync_settings_fail_the_load_naming_the_parameter(
    tmp_path: Path, monkeypatch, parameters: dict[str, str], message: str
) -> None:
    monkeypatch.delenv(SYNC_ENV, raising=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(tmp_path, parameters)


def test_learn_is_a_per_request_override_with_the_models_default(tmp_path: Path) -> None:
    limits = RequestLimits(LookaheadConfig(learn=False), max_prompt_tokens=20, max_output_tokens=64)

    def request(options: dict) -> GenerationRequest:
        tensors = {"text_input": np.array([b"Hi"], dtype=np.object_)}
        if options:
            tensors["sampling_parameters"] = np.array([json.dumps(options).encode()], dtype=np.object_)
        return parse_request(DictInputs(tensors), limits, lambda text: list(text.encode()))

    assert request({}).lookahead.learn is False
    assert request({"learn": "true"}).lookahead.learn is True
    with pytest.raises(RequestError, match="learn must be true or false, got .perhaps."):
        request({"learn": "perhaps"})


# Whatever a peer (or anyone with the Redis URL) writes, the sync thread goes on


def test_an_id_too_long_for_python_is_refused_as_an_entry_error() -> None:
    fields = {b"v": b"1", b"src": b"a", b"ids": b"1," + b"9" * 5000}
    with pytest.raises(EntryError, match="outside the vocabulary") as error:
        decode_entry(fields, vocab_size=VOCAB, max_tokens=4096)
    assert error.value.kind == "ids"


def test_every_malformed_entry_is_counted_and_skipped_and_later_ones_arrive(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as server:
        client = server.client()
        client.xadd(KEY, encode_entry([1, 2], "x"))
        client.xadd(KEY, {"v": "1", "src": "x", "ids": "1," + "9" * 5000})  # int() refuses it
        last_bad = client.xadd(KEY, {"v": "1", "src": b"\xff", "ids": "3"}).decode()  # fine: any source
        client.xadd(KEY, {"v": "1", "src": "x", "ids": "4,4", "extra": "\x00" * 10}).decode()
        last = client.xadd(KEY, {"v": "1", "src": "x", "ids": "1" * 10}).decode()  # outside the vocabulary
        keeper = TrieKeeper(NGramTrie(1000, 4), tmp_path / "t.trie", "fp", interval_s=0, log=Log())
        keeper.join(make_sync(server.url, Log(), max_tokens=1000))
        assert keeper.sync.counts["rejected"] == 2 and keeper.sync.alive
        assert keeper.trie.match([4, 4]) != -1 and keeper.trie.match([3]) != -1
        client.xadd(KEY, encode_entry([5, 6], "x"))
        assert wait_until(lambda: keeper.sync.counts["received"] == 4)
        keeper.between_steps()
        assert keeper.trie.match([5, 6]) != -1
        keeper.close()
        assert last_bad < last
        # the snapshot's position passed the rejected entries: a restart does not read them again
        snapshot = load_snapshot(tmp_path / "t.trie", capacity=1000, max_depth=4, fingerprint="fp")
        assert snapshot.stream["cursor"] > last


def test_a_rejected_last_entry_still_moves_the_snapshots_position(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as server:
        client = server.client()
        client.xadd(KEY, encode_entry([1, 2], "x"))
        bad = client.xadd(KEY, {"v": "1", "src": "x", "ids": "1," + "9" * 5000}).decode()
        keeper = TrieKeeper(NGramTrie(1000, 4), tmp_path / "t.trie", "fp", interval_s=0, log=Log())
        keeper.join(make_sync(server.url, Log(), max_tokens=1000))
        keeper.close()
        assert keeper.stream["cursor"] == bad


# The thread is killed on purpose (an exception no thread catches).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sync_thread_that_died_is_restarted_between_steps(tmp_path: Path, monkeypatch) -> None:
    with running_redis(tmp_path / "redis") as server:
        log = Log()
        keeper = TrieKeeper(NGramTrie(1000, 4), tmp_path / "t.trie", "fp", interval_s=0, log=log)
        sync = make_sync(server.url, Log())
        keeper.join(sync)
        serve = sync._serve

        def dies(client) -> None:
            monkeypatch.setattr(sync, "_serve", serve)  # the next thread serves normally
            raise SystemExit("killed")  # not an Exception: nothing in the thread catches it

        monkeypatch.setattr(sync, "_serve", dies)
        server.client().client_kill_filter(_type="normal", skipme=True)  # the thread reconnects into dies()
        assert wait_until(lambda: not sync.alive)
        server.client().xadd(KEY, encode_entry([7, 8], "x"))
        keeper.between_steps()
        assert sync.alive and any("restart" in line for line in log.lines)
        assert wait_until(lambda: sync.counts["received"] == 1)
        keeper.between_steps()
        assert keeper.trie.match([7, 8]) != -1
        keeper.close()


def test_reading_pauses_while_too_many_received_tokens_wait(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis") as server:
        client = server.client()
        for i in range(30):
            client.xadd(KEY, encode_entry([i] * 1000, "x"))
        sync = make_sync(server.url, Log(), max_tokens=1000, max_waiting_tokens=5000)
        sync.start()
        try:
            time.sleep(1.0)
            assert 0 < sum(len(e.tokens) for e in sync.inbox) <= 5000
            assert not sync.caught_up.is_set()  # paused, not at the end
            taken = []
            assert wait_until(lambda: taken.extend(sync.take()) or len(taken) == 30, 30)
            assert [e.tokens[0] for e in taken] == list(range(30))
        finally:
            sync.stop()


def test_an_honest_entry_as_long_as_the_context_is_accepted() -> None:
    bound = entry_token_bound(context_length=8192)
    output = encode_entry([7] * 8192, "peer")  # a peer's prompt tail and output fill the context
    assert decode_entry(as_fields(output), vocab_size=VOCAB, max_tokens=bound)[1] == [7] * 8192
    with pytest.raises(EntryError, match="more than 8192"):
        decode_entry(as_fields(encode_entry([7] * 8193, "peer")), vocab_size=VOCAB, max_tokens=bound)
    assert entry_token_bound(context_length=None) >= 131_072
