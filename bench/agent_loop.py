"""A coding agent's tool loop through the OpenAI endpoint: lookahead against the baseline model,
greedy, every turn compared.

Each task is about one standard library function (bench/stdlib_sets.py): the agent is asked to
find a bug in it, with three tools (read_file, search_code, run_tests) whose results come from
the interpreter's own sources, so every run sees the same ones. A turn is one request: the whole
conversation so far with the tool definitions, sent as agents send it (the openai SDK,
`tools`, `tool_calls` echoed back, `role: tool` results); the loop goes on while the model calls a
tool, up to --turns requests. What the drafters can reuse is what agents repeat: the tool schema
in every prompt, earlier calls, results the model quotes. Both models follow the same path as
long as their answers are identical, which is checked turn by turn.

With `--repo-map-tokens N` the system prompt also carries an aider-style repository map of about
N tokens (the standard library modules' paths and top-level signatures), as coding agents send
their rules and maps: the same in every task, so the prefix cache reads it once per model.

Each model first answers one untimed one-token request (`warm_up`). Reported per model: output
tokens/s (all turns' output tokens over the summed wall time), its ratio to the baseline's, the
first task's first token (the whole system prompt read cold), the mean time to first token of
turn 1, 2, ... (the prefix cache spares a later turn the prompt it already read), tool calls made,
turns identical to the baseline's (exit status 1 when one differs).
Serve a model whose chat template has tools, e.g.:

    LOOKAHEAD_MODEL=qwen2.5-coder-0.5b-instruct python -m bench agent_loop --tasks 4 --turns 4
    LOOKAHEAD_MODEL=qwen2.5-coder-0.5b-instruct python -m bench agent_loop --repo-map-tokens 3000
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.report import write_csv
from bench.servers import add_comparison_arguments, check_comparison_arguments, server_url
from bench.stdlib_sets import LONG_MODULES, MODULES, coding_conversations, source_of
from launcher import TritonServerError, free_port, start_frontend

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]},
        },
    }
    for name, key, description in (
        ("read_file", "path", "Read a Python module of the standard library, e.g. json/decoder.py"),
        ("search_code", "pattern", "Lines of the task's module that contain the pattern"),
        ("run_tests", "target", "Run the tests of a function, e.g. json.decoder.py_scanstring"),
    )
]
SYSTEM = "You are a coding agent. Use the tools to read code before you answer; answer briefly."
RESULT_LINES = 40  # a tool result's most lines
CHARS_PER_TOKEN = 3.5  # of a repository map, for the tokenizers served here


@dataclass(frozen=True)
class Turn:
    task: int
    turn: int
    model: str
    prompt_tokens: int
    output_tokens: int
    ttft_seconds: float
    seconds: float
    calls: int
    text: str  # the content and the calls, as compared


@dataclass(frozen=True)
class Point:
    model: str
    turns: int
    tool_calls: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    speedup: float
    cold_ttft_ms: float  # the first task's first turn
    ttft_ms_by_turn: str
    identical: int


def repo_map(tokens: int) -> str:
    """About `tokens` tokens of an aider-style repository map: each module's path, then its
    top-level functions' and classes' first lines and their methods', module after module."""
    lines: list[str] = []
    size, budget = 0, tokens * CHARS_PER_TOKEN
    for module in dict.fromkeys(MODULES + LONG_MODULES):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):  # a frozen module
            continue
        source = source_of(module)
        text = source.splitlines()
        entry = [f"{module.replace('.', '/')}.py:"]
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                entry.append(f"  {text[node.lineno - 1].strip()}")
                if isinstance(node, ast.ClassDef):
                    entry += [
                        f"    {text[m.lineno - 1].strip()}"
                        for m in node.body
                        if isinstance(m, ast.FunctionDef) and not m.name.startswith("_")
                    ]
        for line in entry:
            if size + len(line) + 1 > budget:
                return "\n".join(lines)
            lines.append(line)
            size += len(line) + 1
    return "\n".join(lines)


def module_source(name: str) -> tuple[str, str]:
    """(the module's file path under Lib/, its source) for `module.function`."""
    module = name.rsplit(".", 1)[0]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin)
    relative = path.name if path.parent.name.startswith("python") else f"{path.parent.name}/{path.name}"
    return relative, path.read_text(encoding="utf-8")


def run_tool(name: str, arguments: str, task: str) -> str:
    """A tool's result: the task's module, its matching lines or a fixed test report."""
    try:
        argument = next(iter(json.loads(arguments).values()), "")
    except (ValueError, AttributeError):
        return json.dumps({"error": "arguments are not a JSON object"})
    path, source = module_source(task)
    if name == "read_file":
        function = task.rsplit(".", 1)[1]
        node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == function)
        return "\n".join(source.splitlines()[node.lineno - 1 :][:RESULT_LINES])
    if name == "search_code":
        found = [
            f"{path}:{i}: {line}" for i, line in enumerate(source.splitlines(), 1) if str(argument) in line
        ]
        return "\n".join(found[:RESULT_LINES]) or "no match"
    if name == "run_tests":
        return (
            f"FAILED test_{task.rsplit('.', 1)[1]}: AssertionError: wrong result for an empty input\n1 failed"
        )
    return json.dumps({"error": f"unknown tool {name}"})


def agent(
    client: Any, model: str, index: int, task: str, turns: int, max_tokens: int, system: str = SYSTEM
) -> list[Turn]:
    """One task's loop: a request per turn, each tool call answered, until the model answers."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": f"{task} has a bug with empty input. Read it with read_file, then find it.",
        },
    ]
    name, extra = served_as(model)
    done = []
    for number in range(1, turns + 1):
        started, first = time.perf_counter(), None
        with client.chat.completions.stream(
            **extra,
            model=name,
            messages=messages,
            tools=TOOLS,
            max_tokens=max_tokens,
            stream_options={"include_usage": True},
        ) as stream:
            for _ in stream:
                first = first or time.perf_counter()
            reply = stream.current_completion_snapshot  # (the final completion refuses a cut one)
        ended = time.perf_counter()
        message = reply.choices[0].message
        calls = message.tool_calls or []
        text = (message.content or "") + "".join(
            f"\n{c.function.name}({c.function.arguments})" for c in calls
        )
        usage = reply.usage
        done.append(
            Turn(
                index,
                number,
                model,
                usage.prompt_tokens if usage else 0,
                usage.completion_tokens if usage else 0,
                (first or ended) - started,
                ended - started,
                len(calls),
                text,
            )
        )
        if not calls:
            break
        sent = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in calls
        ]
        messages.append({"role": "assistant", "content": message.content, "tool_calls": sent})
        for call in calls:
            result = run_tool(call.function.name, call.function.arguments, task)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return done


def summarize(turns: Sequence[Turn], baseline: str) -> list[Point]:
    texts = {(t.task, t.turn, t.model): t.text for t in turns}
    points = []
    rates = {}
    for model in dict.fromkeys(t.model for t in turns):
        mine = [t for t in turns if t.model == model]
        seconds = sum(t.seconds for t in mine)
        rates[model] = sum(t.output_tokens for t in mine) / seconds
    for model in rates:
        mine = [t for t in turns if t.model == model]
        numbers = sorted({t.turn for t in mine})
        ttft = [1000 * _mean([t.ttft_seconds for t in mine if t.turn == n]) for n in numbers]
        cold = min(mine, key=lambda t: (t.task, t.turn))
        points.append(
            Point(
                model,
                len(mine),
                sum(t.calls for t in mine),
                sum(t.output_tokens for t in mine),
                sum(t.seconds for t in mine),
                rates[model],
                rates[model] / rates[baseline],
                1000 * cold.ttft_seconds,
                " / ".join(f"{ms:.0f}" for ms in ttft),
                sum(texts.get((t.task, t.turn, baseline)) == t.text for t in mine),
            )
        )
    return points


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def format_table(points: Sequence[Point]) -> str:
    lines = [
        "| model | turns | tool calls | output tokens | tokens/s (x baseline) | first TTFT (ms) "
        "| TTFT by turn (ms) | identical |",
        "|---" * 8 + "|",
    ]
    for p in points:
        lines.append(
            f"| {p.model} | {p.turns} | {p.tool_calls} | {p.output_tokens} | {p.tokens_per_second:.1f} "
            f"({p.speedup:.2f}x) | {p.cold_ttft_ms:.0f} | {p.ttft_ms_by_turn} | {p.identical}/{p.turns} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_comparison_arguments(parser)
    parser.add_argument("--tasks", type=int, default=4, help="agent tasks, one stdlib function each")
    parser.add_argument("--offset", type=int, default=0, help="first task")
    parser.add_argument("--turns", type=int, default=6, help="most requests per task")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--repo-map-tokens",
        type=int,
        default=0,
        help="a repository map of about this many tokens in the system prompt",
    )
    parser.add_argument("--openai-url", default=None, help="a running OpenAI endpoint (else one is started)")
    parser.add_argument("--out", type=Path, default=Path("results/agent_loop"))
    args = parser.parse_args(argv)
    return check_comparison_arguments(parser, args)


def served_as(model: str) -> tuple[str, dict[str, Any]]:
    """The served model's name and the request options of a --models entry (NAME:DRAFTER, on a
    running --url: the served model with that per-request drafter)."""
    name, _, drafter = model.partition(":")
    return name, {"extra_body": {"drafter": drafter}} if drafter else {}


def warm_up(client: Any, model: str) -> None:
    """One untimed request of one token, sharing no text with the tasks' prompts: the first
    request of a run otherwise pays for what the frontend and the model set up on first use."""
    name, extra = served_as(model)
    client.chat.completions.create(
        **extra, model=name, messages=[{"role": "user", "content": "Hello"}], max_tokens=1
    )


def main(argv: Sequence[str] | None = None) -> int:
    import openai

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = [c.name for c in coding_conversations()][args.offset : args.offset + args.tasks]
    system = SYSTEM
    if args.repo_map_tokens:
        system += "\n\nRepository map (the Python standard library):\n" + repo_map(args.repo_map_tokens)
    turns: list[Turn] = []
    try:
        with server_url(args) as url, ExitStack() as stack:
            base_url = args.openai_url
            if base_url is None:
                log = args.out / "frontend.log"
                base_url = stack.enter_context(start_frontend(url, free_port(), log_file=log)).url
            client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=1800)
            for model in args.models:  # the first request to a model loads what it loads lazily
                warm_up(client, model)
            for index, task in enumerate(tasks, start=args.offset):
                shift = index % len(args.models)  # the first model rotates from task to task
                for model in args.models[shift:] + args.models[:shift]:
                    turns += agent(client, model, index, task, args.turns, args.max_tokens, system)
                print(f"task {index} ({task}) done", flush=True)
    except TritonServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    points = summarize(turns, args.baseline)
    table = format_table(points)
    print(table)
    (args.out / "agent_loop.md").write_text(f"# Agent tool loops\n\n{table}\n", encoding="utf-8")
    write_csv(points, Point, args.out / "agent_loop.csv")
    (args.out / "turns.json").write_text(
        json.dumps([asdict(t) for t in turns], indent=1) + "\n", encoding="utf-8"
    )
    differing = [p for p in points if p.identical != p.turns]
    for p in differing:
        print(
            f"error: {p.model} differs from {args.baseline} in {p.turns - p.identical} turns", file=sys.stderr
        )
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
