"""Which chat templates render tools: a model whose template has none, or whose tools branch fails,
gets a 400 naming the model; a template's tools reach the prompt."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from frontend.errors import APIError
from frontend.models import ServedModels, _chat_prompt
from frontend.tool_calls import hermes
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "hi"}]
HERMES = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools> call <tool_call>"
    "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_tokenizer(DEFAULT_MODEL)


def family(tokenizer: Any) -> Any:
    models = ServedModels(triton=None, tokenizer="served")  # type: ignore[arg-type]
    models.tokenizers["served"] = tokenizer
    return asyncio.run(models.tool_family("lookahead", parsed=True))


def test_a_template_without_tools_gets_a_400_naming_the_model(smollm2):
    with pytest.raises(APIError) as caught:
        family(smollm2)
    assert caught.value.status == 400 and caught.value.param == "tools"
    assert "model `lookahead` has no tools" in caught.value.message


def test_a_template_with_tools_renders_them_and_names_its_family(smollm2):
    tokenizer = copy.copy(smollm2)
    tokenizer.chat_template = HERMES
    assert family(tokenizer) is hermes.FAMILY
    prompt = _chat_prompt(tokenizer, MESSAGES, TOOLS, "lookahead")
    assert prompt.startswith('<tools>{"type": "function", "function": {"name": "f"') and "user: hi" in prompt


def test_a_template_whose_tools_branch_fails_gets_a_400_naming_the_model(smollm2):
    tokenizer = copy.copy(smollm2)
    tokenizer.chat_template = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}{{ messages }}"
    with pytest.raises(APIError) as caught:
        _chat_prompt(tokenizer, MESSAGES, TOOLS, "lookahead")
    assert (
        caught.value.param == "tools"
        and "model `lookahead` cannot render them: no tools here" in caught.value.message
    )


def test_a_template_with_tools_in_a_syntax_no_parser_knows_gets_a_400(smollm2):
    tokenizer = copy.copy(smollm2)
    tokenizer.chat_template = "{% if tools %}functions: {{ tools }}{% endif %}{{ messages }}"
    with pytest.raises(APIError) as caught:
        family(tokenizer)
    assert "no tool-call parser knows the syntax of model `lookahead`" in caught.value.message
