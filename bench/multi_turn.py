"""Multi-turn coding conversations through the server: lookahead against the baseline model,
one conversation at a time and several at once, greedy, every turn identical.

The conversations (bench/stdlib_sets.py) are about one standard library function
each: the first turn shows it and asks for an edit, each later turn asks for the whole function
again with one more edit. Every turn is sent as a coding agent or a chat client sends it: the
whole conversation so far in the served model's chat template, the earlier turns' actual answers
included, so what the assistant wrote comes back as prompt and, mostly, again as output.

A tritonserver is started with empty tries (--out/trie_state, emptied first). At each level c,
the next c conversations (from --offset on, --conversations per level) run at once, each turn
after the previous one's answer, first on one model and then on the next (the first model
rotating from group to group), so the models share the same minutes of the machine. Reported per
level and model: output tokens/s (all turns' output tokens over the summed wall time of that
model's groups) and its ratio to the baseline's, tokens per decoding step, prompt tokens the
prefix cache spared (sent minus prefilled is not reported by the server: the time to first token
per turn is, as its proxy), and the number of turns whose text equals the baseline's (exit
status 1 when one differs).

    python -m bench multi_turn --concurrency 1,4 --conversations 4
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.genai_perf import served_tokenizer
from bench.report import write_csv
from bench.servers import add_comparison_arguments, check_comparison_arguments, parse_concurrency, server_url
from bench.speedup import complete
from bench.stdlib_sets import Conversation, coding_conversations
from launcher import TritonServerError
from lookahead.models.chat import chat_prompt


@dataclass(frozen=True)
class Turn:
    """One turn of one conversation on one model."""

    concurrency: int
    conversation: int
    turn: int
    model: str
    prompt_tokens: int
    output_tokens: int
    steps: int
    ttft_seconds: float
    seconds: float
    text: str


@dataclass(frozen=True)
class Point:
    concurrency: int
    model: str
    turns: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    speedup: float
    tokens_per_step: float
    ttft_ms_by_turn: str  # mean time to first token of turn 1, 2, ...
    identical: int


def converse(
    url: str,
    model: str,
    tokenizer: object,
    index: int,
    conversation: Conversation,
    level: int,
    max_tokens: int,
) -> list[Turn]:
    """Every turn of one conversation, each with the earlier answers."""
    messages: list[dict[str, str]] = []
    turns = []
    for number, question in enumerate(conversation.turns, start=1):
        messages.append({"role": "user", "content": question})
        prompt = chat_prompt(tokenizer, messages)
        reply = complete(url, model, prompt, max_tokens, {})
        messages.append({"role": "assistant", "content": reply.text})
        turns.append(
            Turn(
                level,
                index,
                number,
                model,
                int(reply.num_input_tokens or 0),
                reply.num_output_tokens,
                int(reply.perf.get("num_decoding_steps", 0)),
                reply.time_to_first_token or 0.0,
                reply.total_seconds or 0.0,
                reply.text,
            )
        )
    return turns


def run_group(
    url: str,
    model: str,
    tokenizer: object,
    group: Sequence[tuple[int, Conversation]],
    level: int,
    max_tokens: int,
) -> tuple[list[Turn], float]:
    """Conversations at once, one thread each; (their turns, wall seconds)."""
    results: list[list[Turn] | BaseException] = [[] for _ in group]

    def one(slot: int) -> None:
        index, conversation = group[slot]
        try:
            results[slot] = converse(url, model, tokenizer, index, conversation, level, max_tokens)
        except BaseException as error:  # reported below, on the caller's thread
            results[slot] = error

    threads = [threading.Thread(target=one, args=(slot,)) for slot in range(len(group))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    turns = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        turns += result
    return turns, elapsed


def summarize(turns: Sequence[Turn], seconds: dict[tuple[int, str], float], baseline: str) -> list[Point]:
    texts = {(t.concurrency, t.conversation, t.turn, t.model): t.text for t in turns}
    points = []
    order = list(dict.fromkeys(t.model for t in turns))
    for level, model in sorted(
        {(t.concurrency, t.model) for t in turns}, key=lambda k: (k[0], order.index(k[1]))
    ):
        mine = [t for t in turns if (t.concurrency, t.model) == (level, model)]
        base = [t for t in turns if (t.concurrency, t.model) == (level, baseline)]
        tokens, steps = sum(t.output_tokens for t in mine), sum(t.steps for t in mine)
        rate = tokens / seconds[level, model]
        base_rate = sum(t.output_tokens for t in base) / seconds[level, baseline]
        numbers = sorted({t.turn for t in mine})
        ttft = [
            1000 * sum(t.ttft_seconds for t in mine if t.turn == n) / sum(t.turn == n for t in mine)
            for n in numbers
        ]
        points.append(
            Point(
                level,
                model,
                len(mine),
                tokens,
                seconds[level, model],
                rate,
                rate / base_rate,
                sum(t.output_tokens - 1 for t in mine) / steps if steps else 0.0,
                " / ".join(f"{ms:.0f}" for ms in ttft),
                sum(texts[level, t.conversation, t.turn, baseline] == t.text for t in mine),
            )
        )
    return points


def format_table(points: Sequence[Point]) -> str:
    lines = [
        "| conversations at once | model | turns | output tokens | tokens/s (x baseline) | tokens/step "
        "| TTFT by turn (ms) | identical |",
        "|---" * 8 + "|",
    ]
    for p in points:
        lines.append(
            f"| {p.concurrency} | {p.model} | {p.turns} | {p.output_tokens} "
            f"| {p.tokens_per_second:.1f} ({p.speedup:.2f}x) | {p.tokens_per_step:.2f} "
            f"| {p.ttft_ms_by_turn} | {p.identical}/{p.turns} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_comparison_arguments(parser)
    parser.add_argument("--concurrency", type=parse_concurrency, default=(1, 4))
    parser.add_argument("--conversations", type=int, default=4, help="conversations per level")
    parser.add_argument("--offset", type=int, default=0, help="first conversation")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--tokenizer", default=None, help="default: the lookahead model's (served_tokenizer)")
    parser.add_argument("--out", type=Path, default=Path("results/multi_turn"))
    args = parser.parse_args(argv)
    return check_comparison_arguments(parser, args)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer or str(served_tokenizer(args.model_repository, "lookahead"))
    )
    conversations = coding_conversations()
    turns: list[Turn] = []
    seconds: dict[tuple[int, str], float] = {}
    first = args.offset
    try:
        with server_url(args) as url:
            for model in args.models:
                complete(url, model, "Hello", 4, {})
            for level in args.concurrency:
                chosen = list(enumerate(conversations))[first : first + args.conversations]
                first += args.conversations
                seconds.update({(level, model): 0.0 for model in args.models})
                for start in range(0, len(chosen), level):
                    group = chosen[start : start + level]
                    shift = (start // level) % len(args.models)
                    for model in args.models[shift:] + args.models[:shift]:
                        group_turns, elapsed = run_group(url, model, tokenizer, group, level, args.max_tokens)
                        turns += group_turns
                        seconds[level, model] += elapsed
                    print(f"c={level}: conversations {[i for i, _ in group]} done", flush=True)
    except TritonServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    points = summarize(turns, seconds, args.baseline)
    table = format_table(points)
    print(table)
    (args.out / "multi_turn.md").write_text(
        f"# Multi-turn coding conversations\n\n{table}\n", encoding="utf-8"
    )
    write_csv(points, Point, args.out / "multi_turn.csv")
    (args.out / "turns.json").write_text(
        json.dumps([asdict(t) for t in turns], indent=1) + "\n", encoding="utf-8"
    )
    differing = [p for p in points if p.identical != p.turns]
    for p in differing:
        print(
            f"error: {p.model} differs from {args.baseline} in {p.turns - p.identical} turns at "
            f"{p.concurrency} conversations at once",
            file=sys.stderr,
        )
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
