"""The prompt-reading mode of the llama.cpp comparison: its prompts and its summary."""

from __future__ import annotations

from bench.peer_llama_cpp import compare_reading, long_prompts
from bench.stdlib_sets import LONG_MODULES, source_of
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_tokenizer


def test_long_prompts_come_near_their_length_and_share_no_source() -> None:
    prompts = long_prompts([300, 900], 2)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    assert [length for length, _ in prompts] == [300, 300, 900, 900]
    for (length, text), module in zip(prompts, LONG_MODULES):
        tokens = len(tokenizer(text)["input_ids"])
        assert length <= tokens <= length + 120, (module, tokens)  # one line short, plus the question
        assert f"from `{module}`" in text
        assert source_of(module).splitlines()[0] in text
    openings = {text.split("```python\n", 1)[1][:200] for _, text in prompts}
    assert len(openings) == len(prompts)


def test_compare_reading_divides_summed_tokens_by_summed_seconds() -> None:
    rows = [
        {"system": "llama.cpp", "length": 1000, "prompt_tokens": 1000, "seconds": 4.0},
        {"system": "llama.cpp", "length": 1000, "prompt_tokens": 1200, "seconds": 4.0},
        {"system": "baseline", "length": 1000, "prompt_tokens": 1000, "seconds": 1.0},
        {"system": "baseline", "length": 1000, "prompt_tokens": 1200, "seconds": 1.2},
    ]
    assert compare_reading(rows) == [
        "~1000 prompt tokens: llama.cpp reads 275 tok/s",
        "~1000 prompt tokens: baseline reads 1000 tok/s = 3.64x llama.cpp's",
    ]
