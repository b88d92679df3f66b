"""The library's command line: `python -m lookahead {prepare,check} ...`."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence

from .models.checks import check_tree_attention
from .models.embedded import prepare_default_model
from .models.loading import NO_FAST_PATH, load_model


def prepare(args: argparse.Namespace) -> int:
    """Convert the default model into the cache and build the fast CPU path's kernels."""
    print(f"default model: {prepare_default_model()}")
    if importlib.util.find_spec("lookahead.cpu") is None:
        print(f"fast CPU path: {NO_FAST_PATH}")
        return 0
    from .cpu import prepare as prepare_fast_path

    for line in prepare_fast_path():
        print(f"fast CPU path: {line}")
    return 0


def check(args: argparse.Namespace) -> int:
    """Load a model and run the tree-attention check."""
    loaded = load_model(args.model)
    check_tree_attention(loaded.model)
    print(f"{loaded.name}: tree attention ok ({loaded.execution}), fingerprint {loaded.fingerprint}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lookahead", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help=prepare.__doc__).set_defaults(run=prepare)
    checking = commands.add_parser("check", help=check.__doc__)
    checking.add_argument("model", help="an embedded model name or a local Hugging Face folder")
    checking.set_defaults(run=check)
    args = parser.parse_args(argv)
    return args.run(args)
