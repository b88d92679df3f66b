"""Command line: send one prompt, print the completion (as it streams with --stream).

    python -m client "Rewrite this function to use a list comprehension: ..." --stream --stats
    cat prompt.txt | python -m client - --model baseline --max-tokens 256

Statistics go to stderr so that stdout holds only the generated text. Any failure is one line
on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from client.api import DEFAULT_URLS, Completion, LookaheadClient
from client.errors import TritonClientError
from lookahead.contract import DECODING_MODES


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--protocol", choices=tuple(DEFAULT_URLS), default="grpc")
    parser.add_argument(
        "--url", help="host:port of Triton (default: localhost:8001 gRPC, localhost:8000 HTTP)"
    )
    parser.add_argument("--model", default="lookahead", help="served model name: lookahead or baseline")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each response")
    sampling = parser.add_argument_group("sampling (server defaults when omitted)")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--temperature", type=float, help="0 decodes greedily")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--seed", type=int)
    sampling.add_argument("--stop", action="append", metavar="TEXT", help="stop string; repeat for several")
    lookahead = parser.add_argument_group("lookahead (capped by the model's configuration)")
    lookahead.add_argument("--no-lookahead", action="store_true", help="decode one token per step")
    lookahead.add_argument("--decoding-length", type=int, help="most tokens verified per step")
    lookahead.add_argument("--branch-length", type=int, help="most draft tokens on one branch")
    lookahead.add_argument("--decoding-mode", choices=DECODING_MODES)
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print tokens/s, time to first token and draft acceptance to stderr",
    )
    return parser.parse_args(argv)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """Only the options given on the command line, so the server's defaults apply to the rest."""
    options = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "use_lookahead": False if args.no_lookahead else None,
        "decoding_length": args.decoding_length,
        "branch_length": args.branch_length,
        "decoding_mode": args.decoding_mode,
    }
    return {name: value for name, value in options.items() if value is not None}


def format_stats(completion: Completion) -> str:
    """Human-readable statistics; perf metrics appear only when the server reported them."""
    rows = [
        ("output tokens", f"{completion.num_output_tokens}"),
        ("total time", _seconds(completion.total_seconds)),
        ("tokens/s", _number(completion.tokens_per_second, ".1f")),
        ("time to first token", _seconds(completion.time_to_first_token)),
        ("finish reason", completion.finish_reason or "-"),
    ]
    perf = completion.perf
    if "num_decoding_steps" in perf:
        rows += [
            ("decoding steps", f"{perf['num_decoding_steps']}"),
            ("accepted draft tokens per step", _number(completion.accepted_draft_tokens_per_step, ".2f")),
            (
                "draft tokens accepted",
                f"{perf.get('total_accepted_draft_tokens', 0)} of {perf.get('total_draft_tokens', 0)}"
                f" ({_number(perf.get('acceptance_rate'), '.1%')})",
            ),
        ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run(args: argparse.Namespace) -> Completion:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    client = LookaheadClient(url=args.url, protocol=args.protocol, model=args.model, timeout_s=args.timeout)
    options = sampling_options(args)
    if not args.stream:
        completion = client.generate(prompt, **options)
        sys.stdout.write(completion.text)
    else:
        chunks = []
        for chunk in client.stream(prompt, **options):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            chunks.append(chunk)
        completion = Completion.from_chunks(chunks)
    if not completion.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    return completion


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        completion = run(args)
    except TritonClientError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.stats:
        print(format_stats(completion), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
