"""ChatGLM3's own checkpoint format on transformers' GLM: the original code's references, no remote code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.models.chat import apply_chat_template
from lookahead.models.chatglm import ChatGLMFormatError, glm_config
from lookahead.models.chatglm_tokenizer import SPECIAL_TOKENS
from lookahead.models.loading import load_model

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "chatglm3-tiny"
REFERENCES = [json.loads(line) for line in (FIXTURE / "reference.jsonl").read_text().splitlines()]
CONFIG = json.loads((FIXTURE / "config.json").read_text())


@pytest.fixture(scope="module")
def chatglm():
    """On the default execution path (the packed kernel where this CPU runs it)."""
    return load_model(str(FIXTURE), require_tokenizer=False)


def assert_references(loaded, config: LookaheadConfig) -> None:
    decoder = LookaheadDecoder.for_model(loaded, NGramTrie(capacity=100_000))
    drafted = 0
    for row in REFERENCES:
        ids, stats = decoder.generate(
            row["prompt_ids"], SamplingParams(max_tokens=48, ignore_eos=True), config
        )
        assert ids == row["greedy_ids"], f"prompt of {len(row['prompt_ids'])} tokens"
        drafted += stats.draft_tokens
    assert (drafted > 0) == config.use_lookahead


def test_the_fixture_loads_as_transformers_glm(chatglm) -> None:
    assert type(chatglm.model).__name__ == "GlmForCausalLM"
    assert chatglm.eos_token_ids == (2,)
    assert len(chatglm.tokenizer) == 256


@pytest.mark.parametrize("use_lookahead", [True, False])
def test_greedy_output_equals_the_original_code(chatglm, use_lookahead: bool) -> None:
    assert_references(chatglm, LookaheadConfig(use_lookahead=use_lookahead))


def test_stock_layers_reproduce_the_original_code() -> None:
    """Tokens exactly; logits up to summation order (the attention kernels add in another order)."""
    loaded = load_model(str(FIXTURE), linear_kernel="stock", require_tokenizer=False)
    assert loaded.linear_kernel == "stock"
    for row in REFERENCES:
        with torch.inference_mode():
            logits = loaded.model(torch.tensor([row["prompt_ids"]])).logits[0, -1, :8]
        torch.testing.assert_close(logits, torch.tensor(row["last_logits_head"]), rtol=1e-5, atol=1e-5)
    assert_references(loaded, LookaheadConfig())


def test_no_file_of_the_folder_is_executed(tmp_path: Path) -> None:
    folder = tmp_path / "chatglm3"
    shutil.copytree(FIXTURE, folder)
    marker = tmp_path / "executed"
    for module in ("modeling_chatglm.py", "configuration_chatglm.py"):
        (folder / module).write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(3)\n")
    loaded = load_model(str(folder), require_tokenizer=False)
    assert type(loaded.model).__name__ == "GlmForCausalLM"
    assert not marker.exists()


def test_rope_ratio_scales_the_rope_base(tmp_path: Path) -> None:
    assert glm_config(CONFIG).rope_parameters["rope_theta"] == 10000.0
    folder = tmp_path / "chatglm3-32k"
    shutil.copytree(FIXTURE, folder)
    (folder / "config.json").write_text(json.dumps(CONFIG | {"rope_ratio": 50}))
    scaled = load_model(str(folder), linear_kernel="stock", require_tokenizer=False).model
    dim = CONFIG["kv_channels"] // 2
    expected = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    assert torch.equal(scaled.model.rotary_emb.inv_freq, expected)
    prompt = torch.tensor([REFERENCES[-1]["prompt_ids"]])
    with torch.inference_mode():
        assert scaled(prompt).logits[0, -1, :8].tolist() != REFERENCES[-1]["last_logits_head"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("rmsnorm", False), ("add_bias_linear", True), ("apply_residual_connection_post_layernorm", True)],
)
def test_flags_glm_cannot_compute_are_refused_by_name(tmp_path: Path, flag: str, value: bool) -> None:
    folder = tmp_path / "chatglm-other"
    shutil.copytree(FIXTURE, folder)
    (folder / "config.json").write_text(json.dumps(CONFIG | {flag: value}))
    with pytest.raises(ChatGLMFormatError, match=f"ChatGLM config {flag}={value} is not supported"):
        load_model(str(folder), require_tokenizer=False)


def test_a_folder_without_weights_or_with_unknown_tensors_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "chatglm-empty"
    folder.mkdir()
    shutil.copy(FIXTURE / "config.json", folder)
    with pytest.raises(ChatGLMFormatError, match="has no model.safetensors or pytorch_model.bin"):
        load_model(str(folder), require_tokenizer=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(FIXTURE / "model.safetensors")
    tensors["transformer.encoder.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ChatGLMFormatError, match="unknown ChatGLM tensor 'transformer.encoder.layers.0.extra.weight'"
    ):
        load_model(str(folder), require_tokenizer=False)


def test_the_server_path_requires_a_tokenizer() -> None:
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_model(str(FIXTURE))


@pytest.fixture(scope="module")
def chatglm_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture plus a small SentencePiece tokenizer.model, as a chatglm3-6b folder holds one."""
    import sentencepiece

    folder = tmp_path_factory.mktemp("chatglm3-tokenizer") / "chatglm3-tiny"
    shutil.copytree(FIXTURE, folder)
    corpus = folder.parent / "corpus.txt"
    words = "def add: return print value list index the model token draft tree branch".split()
    corpus.write_text(
        "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(9)) for i in range(300))
    )
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=120,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    return folder


def test_text_works_through_tokenizer_model_alone(chatglm_with_tokenizer: Path) -> None:
    loaded = load_model(str(chatglm_with_tokenizer))
    tokenizer = loaded.tokenizer
    assert len(tokenizer) == 120 + len(SPECIAL_TOKENS)
    specials = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert list(specials.values()) == list(range(120, 129))
    text = "def add value: return the value"
    ids = tokenizer.encode(text)
    assert ids[:2] == [specials["[gMASK]"], specials["sop"]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == "[gMASK]sop" + text
    prompt = apply_chat_template(tokenizer, "print the list")
    newline = tokenizer.sp.encode("\n")
    assert prompt == [
        specials["[gMASK]"],
        specials["sop"],
        specials["<|user|>"],
        *newline,
    ] + tokenizer.sp.encode("print the list") + [specials["<|assistant|>"]]
    assert loaded.eos_token_ids == (2, specials["<|user|>"], specials["<|observation|>"])
    decoder = LookaheadDecoder.for_model(loaded, NGramTrie(capacity=10_000))
    generation = decoder.start(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    streamed = ""
    while not generation.finished:
        streamed += generation.step().text
    assert streamed == tokenizer.decode(generation.output_ids, skip_special_tokens=True)
