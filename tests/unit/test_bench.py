"""One home for measurement: `python -m bench NAME` runs every benchmark, `--help` lists them all,
and docs/BENCHMARKS.md has one section per benchmark."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from bench import BENCHMARKS
from bench.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_benchmark(capsys: pytest.CaptureFixture) -> None:
    assert main(["--help"]) == 0
    listed = re.findall(r"^  (\w+)  ", capsys.readouterr().out, flags=re.MULTILINE)
    assert listed == list(BENCHMARKS)


def test_an_unknown_name_is_refused_with_the_list(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench_forward"]) == 2
    error = capsys.readouterr().err
    assert "no benchmark 'bench_forward'" in error and "forward_cost" in error


def test_every_module_with_a_main_is_a_listed_benchmark() -> None:
    with_main = {
        path.stem
        for path in (ROOT / "bench").glob("*.py")
        if path.stem != "__main__"
        and any(
            isinstance(node, ast.FunctionDef) and node.name == "main"
            for node in ast.parse(path.read_text()).body
        )
    }
    assert with_main == set(BENCHMARKS)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_parses_its_arguments(name: str, capsys: pytest.CaptureFixture) -> None:
    importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench {name}")


def test_each_section_of_the_benchmarks_document_is_one_benchmark() -> None:
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    headings = re.findall(r"^## (.*)$", text, flags=re.MULTILINE)
    named = [re.findall(r"`python -m bench (\w+)`", heading) for heading in headings]
    assert all(len(names) == 1 for names in named), headings
    assert sorted(names[0] for names in named) == sorted(BENCHMARKS)
