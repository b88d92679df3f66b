"""`python -m bench fleet`: replicas that learn together (trie_sync) against the same
replicas learning alone, on one machine.

Starts a redis-server and N tritonservers. Each serves two models of the same weights:
`lookahead`, syncing through the Redis, and `isolated`, the same without trie_sync. A code-editing
stream of N prompts is dealt round-robin: in round r replica s serves prompt (s + r) mod N, so
every prompt reaches every replica once and no replica sees a prompt twice; the replicas serve a
round in parallel, first through `isolated`, then through `lookahead`, so both see the same load.
Greedy decoding: both models' texts must agree (exit 1 otherwise).

Also times what sync adds to the engine thread per step, in this process: `between_steps` with
nothing received, inserting one received entry, and queueing one for publishing.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.local_redis import RedisServer
from bench.prompt_sets import load_prompt_set
from launcher import TritonServer, free_port, start_server
from lookahead.algorithm.trie import NGramTrie
from lookahead.state.keeper import TrieKeeper
from lookahead.state.sync import TrieSync

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
MODES = ("isolated", "lookahead")


@dataclass
class Reply:
    text: str
    output_tokens: int
    accepted: int
    steps: int


class Log:
    def log_info(self, message: str) -> None:
        pass

    def log_warn(self, message: str) -> None:
        print(f"warning: {message}", file=sys.stderr)

    log_error = log_warn


def set_parameter(config: str, key: str, value: str) -> str:
    pattern = rf'(\{{ key: "{key}", value: \{{ string_value: )"[^"]*"'
    config, replaced = re.subn(pattern, rf'\1"{value}"', config)
    if replaced != 1:
        raise ValueError(f"parameter {key} not found in config.pbtxt")
    return config


def replica_repository(root: Path, redis_url: str) -> Path:
    """`lookahead` (syncing) and `isolated` (alone), their tries in root/state."""
    for model, sync in (("lookahead", redis_url), ("isolated", "")):
        shutil.copytree(REPOSITORY / "lookahead", root / "repository" / model)
        config = root / "repository" / model / "config.pbtxt"
        text = set_parameter(config.read_text(), "trie_sync", sync)
        config.write_text(set_parameter(text, "trie_state_dir", str(root / "state")))
    return root / "repository"


def ask(server: TritonServer, model: str, prompt: str, max_tokens: int) -> Reply:
    body = {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "return_perf_metrics": True,
        "parameters": {"max_tokens": max_tokens, "ignore_eos": True},
    }
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.loads(response.read())
    return Reply(
        reply["text_output"], max_tokens, reply["total_accepted_draft_tokens"], reply["num_decoding_steps"]
    )


def run_fleet(replicas: int, max_tokens: int, root: Path) -> dict[str, dict[str, float]]:
    prompts = load_prompt_set("code_edit", limit=replicas).prompts
    redis = RedisServer(root / "redis").start()
    servers: list[TritonServer] = []
    try:
        for s in range(replicas):
            folder = root / f"replica{s}"
            servers.append(
                start_server(
                    replica_repository(folder, redis.url),
                    http_port=free_port(),
                    grpc_port=free_port(),
                    metrics_port=free_port(),
                    log_file=folder / "server.log",
                    ready_timeout_s=900,
                )
            )
        replies: dict[tuple[str, int, int], Reply] = {}
        wall = dict.fromkeys(MODES, 0.0)
        for round_ in range(replicas):
            for mode in MODES:
                jobs = [(s, (s + round_) % replicas) for s in range(replicas)]

                def serve(s: int, p: int, mode: str = mode) -> None:
                    replies[(mode, s, p)] = ask(servers[s], mode, prompts[p], max_tokens)

                threads = [threading.Thread(target=serve, args=job) for job in jobs]
                started = time.perf_counter()
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                wall[mode] += time.perf_counter() - started
            time.sleep(1.5)  # what the round taught the fleet reaches every replica
        for (mode, s, p), reply in replies.items():
            if reply.text != replies[("isolated", s, p)].text:
                raise SystemExit(f"replica {s}, prompt {p}: {mode} and isolated outputs differ")
        summary = {}
        for mode in MODES:
            mine = [reply for (m, _, _), reply in replies.items() if m == mode]
            tokens = sum(reply.output_tokens for reply in mine)
            summary[mode] = {
                "tokens_per_s": tokens / wall[mode],
                "tokens_per_step": tokens / sum(reply.steps for reply in mine),
                "accepted_per_token": sum(reply.accepted for reply in mine) / tokens,
            }
        return summary
    finally:
        for server in servers:
            server.stop()
        redis.kill()


def step_cost(root: Path, repeats: int) -> dict[str, float]:
    """Microseconds the engine thread spends on sync between two steps."""
    redis = RedisServer(root / "redis-step").start()
    try:
        trie = NGramTrie(capacity=1_000_000, max_depth=16)
        keeper = TrieKeeper(trie, root / "step.trie", "bench", interval_s=0, log=Log())
        options = dict(vocab_size=50_000, max_tokens=4096, max_entries=10_000, log=Log())
        keeper.join(TrieSync(redis.url, "bench:trie:x", **options))
        other = TrieSync(redis.url, "bench:trie:x", **options)
        other.start()
        entry = [(i * 7919) % 50_000 for i in range(192)]  # ~ one request's prompt tail + output

        def timed(action) -> float:
            started = time.perf_counter()
            action()
            return (time.perf_counter() - started) * 1e6

        idle = [timed(keeper.between_steps) for _ in range(repeats)]
        inserts = []
        for _ in range(min(repeats, 200)):
            other.publish(entry)
            deadline = time.monotonic() + 5
            while not keeper.sync.inbox and time.monotonic() < deadline:
                time.sleep(0.001)
            inserts.append(timed(keeper.between_steps))
        publish = [timed(lambda: keeper.sync.publish(entry)) for _ in range(repeats)]
        other.stop()
        keeper.close()
        return {
            "between_steps_nothing_received_us": statistics.median(idle),
            "between_steps_one_entry_of_192_tokens_us": statistics.median(inserts),
            "publish_one_entry_us": statistics.median(publish),
        }
    finally:
        redis.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--step-repeats", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="fleet-benchmark-") as folder:
        root = Path(folder)
        results["step_cost"] = cost = step_cost(root, args.step_repeats)
        print(
            "sync's cost on the engine thread, median µs: "
            + ", ".join(f"{k} {v:.1f}" for k, v in cost.items())
        )
        print(
            "| replicas | mode | output tokens/s | tokens per step | accepted draft tokens per output token |"
        )
        print("|---|---|---|---|---|")
        for replicas in args.replicas:
            summary = run_fleet(replicas, args.max_tokens, root / f"fleet{replicas}")
            results[f"replicas_{replicas}"] = summary
            for mode in MODES:
                row = summary[mode]
                name = "trie_sync" if mode == "lookahead" else "isolated"
                print(
                    f"| {replicas} | {name} | {row['tokens_per_s']:.1f} | {row['tokens_per_step']:.2f} "
                    f"| {row['accepted_per_token']:.2f} |",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
