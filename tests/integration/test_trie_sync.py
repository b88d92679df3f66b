"""Replicas that learn together: real tritonservers sharing one real redis-server (trie_sync).

One fleet serves the whole module, in the order of its tests: replica A starts while Redis is
still down, replica B (with an `isolated` model beside it that does not sync) starts later, then
both serve through garbage in the stream, a killed Redis, a Redis restarted empty and a hung one.
Every generation is greedy, so every replica's text must equal the isolated model's.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.local_redis import RedisServer
from launcher import TritonServer
from lookahead.state.sync import encode_entry
from tests.integration.servers import copy_repository, launch, set_parameter
from tests.integration.test_server import is_ready, wait_for
from tests.redis_server import require_redis_server

PROMPTS = {
    "warm": "def merge_sorted(left, right):",
    "live": "class Stack:\n    def __init__(self):",
    "private": "def parse_ini(text):",
    "fault": "def is_prime(n):",
}
MAX_TOKENS = 48
REQUEST_TIMEOUT_S = 600  # a 2-core machine shared with other work can be very slow


class Fleet:
    """The module's Redis, its replicas, and what they answered."""

    def __init__(self, root: Path):
        self.root = root
        self.redis = RedisServer(root / "redis")  # not started: replica A meets a Redis that is down
        self.servers: dict[str, TritonServer] = {}

    def repository(self, name: str, *, isolated: bool) -> Path:
        """lookahead syncing through self.redis; with isolated, also `isolated`, the same model alone."""
        target = copy_repository(self.root / name, self.root / f"{name}-state", ("lookahead",))
        config = target / "lookahead" / "config.pbtxt"
        config.write_text(set_parameter(config.read_text(), "trie_sync", self.redis.url))
        if isolated:
            shutil.copytree(target / "lookahead", target / "isolated")
            config = target / "isolated" / "config.pbtxt"
            config.write_text(set_parameter(config.read_text(), "trie_sync", ""))
        return target

    def start(self, name: str, *, isolated: bool = False) -> TritonServer:
        server = launch(self.repository(name, isolated=isolated), self.root / f"{name}.log")
        self.servers[name] = server
        return server

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.redis.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_redis_server()
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        yield fleet
    finally:
        fleet.stop()


def ask(server: TritonServer, prompt: str, model: str = "lookahead", **parameters: Any) -> dict[str, Any]:
    body = {
        "text_input": prompt,
        "return_perf_metrics": True,
        "parameters": {"max_tokens": MAX_TOKENS, **parameters},
    }
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        return json.loads(reply.read())


# The lookahead model's one instance (every instance labels its own series: backend/metrics.py).
LABELS = r'instance="lookahead_0_0",model="lookahead",pid="\d+",version="1"'


def sync_counts(server: TritonServer) -> dict[str, float]:
    """lookahead_trie_sync_<kind>_total of the lookahead model."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    found = re.findall(rf"^lookahead_trie_sync_(\w+)_total\{{{LABELS}\}} (\S+)$", text, re.MULTILINE)
    return {kind: float(value) for kind, value in found}


def trie_nodes(server: TritonServer) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return float(re.search(rf"^lookahead_trie_nodes\{{{LABELS}\}} (\S+)$", text, re.M)[1])


def log_lines(server: TritonServer, text: str) -> list[str]:
    return [line for line in server.log_file.read_text(errors="replace").splitlines() if text in line]


def test_a_replica_starts_ready_while_redis_is_down_and_publishes_once_it_is_up(fleet: Fleet) -> None:
    a = fleet.start("a")
    assert is_ready(a)
    assert len(log_lines(a, "trie sync: Redis at")) == 1
    assert ask(a, PROMPTS["warm"])["text_output"].startswith(PROMPTS["warm"])  # answered, cold
    fleet.redis.start()
    assert wait_for(lambda: sync_counts(a).get("published", 0) >= 1, 60), sync_counts(a)
    assert sync_counts(a)["reconnects"] == 1
    assert len(log_lines(a, "trie sync: Redis at")) == 1  # one outage, one line, however many retries
    entries = fleet.redis.client().xrange(next(iter(fleet.redis.client().scan_iter("lookahead:trie:*"))))
    assert len(entries) == 1 and entries[0][1][b"v"] == b"1"


def test_a_replica_started_later_is_warm_and_drafts_what_the_first_generated(fleet: Fleet) -> None:
    b = fleet.start("b", isolated=True)
    assert sync_counts(b).get("received", 0) >= 1  # the retained history, read at load
    warm = ask(b, PROMPTS["warm"])
    alone = ask(b, PROMPTS["warm"], model="isolated")
    assert warm["text_output"] == alone["text_output"]
    assert warm["total_accepted_draft_tokens"] > alone["total_accepted_draft_tokens"]
    assert warm["num_decoding_steps"] < alone["num_decoding_steps"]


def test_a_running_replica_drafts_what_another_just_generated(fleet: Fleet) -> None:
    a, b = fleet.servers["a"], fleet.servers["b"]
    received = sync_counts(b).get("received", 0)
    first = ask(a, PROMPTS["live"])
    started = time.monotonic()
    assert wait_for(lambda: sync_counts(b).get("received", 0) > received, 30)
    assert time.monotonic() - started < 5  # within about a second; metrics are scraped with a lag
    shared = ask(b, PROMPTS["live"])
    alone = ask(b, PROMPTS["live"], model="isolated")
    assert shared["text_output"] == alone["text_output"] == first["text_output"]
    assert shared["total_accepted_draft_tokens"] > alone["total_accepted_draft_tokens"]
    assert shared["num_decoding_steps"] < alone["num_decoding_steps"]


def test_learn_false_is_neither_learned_nor_published(fleet: Fleet) -> None:
    a, b = fleet.servers["a"], fleet.servers["b"]
    client = fleet.redis.client()
    key = next(iter(client.scan_iter("lookahead:trie:*")))
    time.sleep(1.5)  # what B published earlier is in A's trie by now
    ask(a, PROMPTS["fault"], learn=False, max_tokens=4)  # refreshes A's trie-size gauge
    time.sleep(0.5)  # the metrics thread applies it
    length, published, nodes = client.xlen(key), sync_counts(a)["published"], trie_nodes(a)
    private = ask(a, PROMPTS["private"], learn=False)
    time.sleep(0.5)
    assert trie_nodes(a) == nodes  # A's own trie did not learn it
    time.sleep(1.5)
    assert client.xlen(key) == length and sync_counts(a)["published"] == published
    on_b = ask(b, PROMPTS["private"], learn=False)
    alone = ask(b, PROMPTS["private"], model="isolated")
    assert private["text_output"] == on_b["text_output"] == alone["text_output"]
    assert client.xlen(key) == length
    # Learned normally, the same prompt then drafts on the other replica.
    ask(a, PROMPTS["private"])
    assert wait_for(lambda: client.xlen(key) == length + 1, 10)


def test_garbage_in_the_stream_fails_no_request(fleet: Fleet) -> None:
    a, b = fleet.servers["a"], fleet.servers["b"]
    client = fleet.redis.client()
    key = next(iter(client.scan_iter("lookahead:trie:*")))
    rejected = sync_counts(b).get("rejected", 0)
    for fields in (
        {"v": "1", "src": "x", "ids": "12,not-a-number"},
        {"v": "1", "src": "x", "ids": "1,2,999999999"},
        {"v": "1", "src": "x", "ids": ",".join(["7"] * 200_000)},
        {"v": "2", "src": "x", "ids": "1,2,3"},
        {"junk": "entry"},
    ):
        client.xadd(key, fields)
    client.xadd(key, encode_entry([1, 2, 3], "x"))
    assert wait_for(lambda: sync_counts(b).get("rejected", 0) == rejected + 5, 30), sync_counts(b)
    expected = ask(b, PROMPTS["fault"], model="isolated")["text_output"]
    for server in (a, b):
        assert ask(server, PROMPTS["fault"])["text_output"] == expected
        assert is_ready(server)
        assert len(log_lines(server, "kind are only counted")) == 3  # ids, size, version: once each


def test_redis_killed_restarted_empty_and_hung_fails_no_request(fleet: Fleet) -> None:
    a, b = fleet.servers["a"], fleet.servers["b"]
    expected = ask(b, PROMPTS["fault"], model="isolated")["text_output"]
    reconnects = {server: sync_counts(server)["reconnects"] for server in (a, b)}

    fleet.redis.kill()
    for server in (a, b):
        assert ask(server, PROMPTS["fault"])["text_output"] == expected and is_ready(server)

    fleet.redis.start()  # the same port, empty
    for server in (a, b):  # both back before the hang: a reconnection during it ends no outage
        assert wait_for(
            lambda server=server: sync_counts(server)["reconnects"] == reconnects[server] + 1, 60
        ), sync_counts(server)
    assert ask(a, PROMPTS["live"], max_tokens=8)["text_output"]
    assert wait_for(lambda: any(fleet.redis.client().scan_iter("lookahead:trie:*")), 30)
    key = next(iter(fleet.redis.client().scan_iter("lookahead:trie:*")))
    assert fleet.redis.client().xlen(key) >= 1  # publishing again into the new, empty Redis

    fleet.redis.pause()  # accepts connections, answers nothing
    try:
        for server in (a, b):
            started = time.monotonic()
            assert ask(server, PROMPTS["fault"])["text_output"] == expected and is_ready(server)
            assert time.monotonic() - started < 60
        for server in (a, b):  # the hang is noticed (a socket timeout) and logged, once
            assert wait_for(lambda server=server: len(log_lines(server, "trie sync: Redis at")) >= 2, 60)
    finally:
        fleet.redis.resume()
    for server in (a, b):
        assert 2 <= len(log_lines(server, "trie sync: Redis at")) <= 4  # once per outage, not per request
