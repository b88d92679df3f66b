"""The comparison benchmarks' models: each NAME:DRAFTER is a model of its own, so that no entry
drafts from, or finds cached, what another entry was just asked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.servers import REPO_ROOT, add_comparison_arguments, check_comparison_arguments


def parse(argv: list[str], out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_comparison_arguments(parser)
    parser.add_argument("--out", type=Path, default=out)
    return check_comparison_arguments(parser, parser.parse_args(argv))


def test_a_drafter_variant_is_served_as_a_copy_with_its_own_drafter(tmp_path: Path) -> None:
    args = parse(["--models", "lookahead", "lookahead:hybrid", "baseline"], tmp_path)
    assert args.models == ["lookahead", "lookahead_hybrid", "baseline"] and args.start_server
    repository = args.model_repository
    assert sorted(path.name for path in repository.iterdir()) == ["baseline", "lookahead", "lookahead_hybrid"]
    shipped = (REPO_ROOT / "model_repository" / "lookahead" / "config.pbtxt").read_text()
    variant = (repository / "lookahead_hybrid" / "config.pbtxt").read_text()
    assert 'key: "drafter", value: { string_value: "trie" }' in shipped
    assert variant == shipped.replace(
        'key: "drafter", value: { string_value: "trie" }', 'key: "drafter", value: { string_value: "hybrid" }'
    )
    assert (repository / "lookahead_hybrid" / "1" / "model.py").resolve() == (
        REPO_ROOT / "model_repository" / "lookahead" / "1" / "model.py"
    )


def test_a_running_server_may_not_serve_two_entries_with_one_model(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["--url", "localhost:8001", "--models", "lookahead", "lookahead:hybrid", "baseline"], tmp_path)
    assert "serve one model twice" in capsys.readouterr().err
    args = parse(["--url", "localhost:8001", "--models", "lookahead:hybrid", "baseline"], tmp_path)
    assert args.models == ["lookahead:hybrid", "baseline"] and not args.start_server
