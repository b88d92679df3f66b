"""Structured outputs through the server: lookahead with a JSON schema against plain constrained
decoding (the baseline model, same schema) and against lookahead without one, on the
JSON-extraction prompt set (bench/json_extraction.py, a schema per prompt).

Requests run one at a time over gRPC streaming, greedy, each prompt through the three settings in
turn, so the ratios come from the same minutes of the machine; one short request per model first
warms it. Rates are given end to end and for decoding alone (after the first response, which
holds the prefill: the prefix cache spares the unconstrained run the prompt the constrained
lookahead run has just prefilled). Every constrained output is checked: it
must parse and conform to its schema, and lookahead's must equal the baseline's.

    python -m bench structured --start-server --prompts 8
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from bench.json_extraction import json_extraction_prompts, schema_errors
from bench.report import markdown_table, write_csv
from bench.servers import add_server_arguments, server_url
from client.api import Completion, LookaheadClient
from launcher import TritonServerError

from .genai_perf import served_tokenizer

SETTINGS = (  # (name, model, constrained)
    ("baseline + grammar", "baseline", True),
    ("lookahead + grammar", "lookahead", True),
    ("lookahead, no grammar", "lookahead", False),
)


@dataclass(frozen=True)
class Run:
    setting: str
    prompt: int
    output_tokens: int
    seconds: float
    decode_tokens: int  # after the first response
    decode_seconds: float
    steps: int
    accepted_draft_tokens: int
    finish_reason: str
    conforms: bool  # parses and conforms to the prompt's schema
    text: str


def chat_prompts(model_repository: Path, count: int) -> list[tuple[str, dict]]:
    tokenizer = AutoTokenizer.from_pretrained(served_tokenizer(model_repository, "lookahead"))
    return [
        (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p.instruction}], tokenize=False, add_generation_prompt=True
            ),
            p.schema,
        )
        for p in json_extraction_prompts(count)
    ]


def conforms(text: str, schema: dict) -> bool:
    try:
        return not schema_errors(json.loads(text), schema)
    except json.JSONDecodeError:
        return False


def run_prompts(url: str, prompts: list[tuple[str, dict]], max_tokens: int) -> list[Run]:
    for model in {model for _, model, _ in SETTINGS}:
        LookaheadClient(url, model=model).generate("Hello", max_tokens=4)
    runs = []
    for index, (prompt, schema) in enumerate(prompts):
        for setting, model, constrained in SETTINGS:
            extra = {"structured_outputs": {"json": schema}} if constrained else {}
            chunks = list(LookaheadClient(url, model=model).stream(prompt, max_tokens=max_tokens, **extra))
            reply = Completion.from_chunks(chunks)
            runs.append(
                Run(
                    setting,
                    index,
                    reply.num_output_tokens,
                    reply.total_seconds or 0.0,
                    reply.num_output_tokens - chunks[0].num_output_tokens,
                    chunks[-1].seconds - chunks[0].seconds,
                    int(reply.perf.get("num_decoding_steps", 0)),
                    int(reply.perf.get("total_accepted_draft_tokens", 0)),
                    reply.finish_reason or "",
                    conforms(reply.text, schema),
                    reply.text,
                )
            )
            print(
                f"prompt {index} {setting}: {reply.num_output_tokens} tokens in {runs[-1].seconds:.2f} s",
                flush=True,
            )
    return runs


def summary(runs: Sequence[Run]) -> str:
    """The table: output tokens/s per setting, x the baseline with the grammar."""
    rows = []
    for setting, _, _ in SETTINGS:
        mine = [run for run in runs if run.setting == setting]
        tokens, seconds = sum(r.output_tokens for r in mine), sum(r.seconds for r in mine)
        decode_tokens, decode_seconds = (
            sum(r.decode_tokens for r in mine),
            sum(r.decode_seconds for r in mine),
        )
        steps = sum(r.steps for r in mine)
        rows.append(
            (
                setting,
                len(mine),
                tokens,
                tokens / seconds if seconds else 0.0,
                decode_tokens / decode_seconds if decode_seconds else 0.0,
                (tokens - len(mine)) / steps if steps else 0.0,
                sum(r.conforms for r in mine),
            )
        )
    base, base_decode = rows[0][3] or 1.0, rows[0][4] or 1.0
    header = ("setting", "requests", "output tokens", "tokens/s (x baseline + grammar)")
    header += ("decoding tokens/s (x)", "tokens/step", "conforming")
    table = [
        (
            setting,
            count,
            tokens,
            f"{rate:.1f} ({rate / base:.2f}x)",
            f"{decode_rate:.1f} ({decode_rate / base_decode:.2f}x)",
            f"{per_step:.2f}",
            f"{valid}/{count}",
        )
        for setting, count, tokens, rate, decode_rate, per_step, valid in rows
    ]
    return markdown_table(header, table)


def mismatches(runs: Sequence[Run]) -> list[int]:
    """Prompts whose constrained lookahead output differs from the baseline's."""
    texts = {(r.setting, r.prompt): r.text for r in runs}
    prompts = sorted({r.prompt for r in runs})
    return [p for p in prompts if texts[SETTINGS[0][0], p] != texts[SETTINGS[1][0], p]]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(parser, warm_trie=False)
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the JSON-extraction set")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens generated per request")
    parser.add_argument("--out", type=Path, default=Path("results/structured"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = chat_prompts(args.model_repository, args.prompts)
    try:
        with server_url(args) as url:
            runs = run_prompts(url, prompts, args.max_tokens)
    except TritonServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    table = summary(runs)
    print(table)
    differing = mismatches(runs)
    (args.out / "structured.md").write_text(f"# Structured outputs, {args.prompts} prompts\n\n{table}\n")
    write_csv(runs, Run, args.out / "structured.csv")
    print(f"wrote {args.out / 'structured.md'} and structured.csv")
    if differing:
        print(f"error: lookahead's constrained output differs from the baseline's on prompts {differing}")
        return 1
    return 0
