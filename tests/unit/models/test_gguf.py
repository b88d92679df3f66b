"""GGUF files by path: their integer forms, exact against gguf's dequantisation; models loaded as
transformers loads them, without an fp32 copy; one clear line for a bad file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from torch import nn
from transformers import AutoModelForCausalLM

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.cli import main
from lookahead.cpu.extension import load_extension
from lookahead.cpu.integer_forms import IntegerForm
from lookahead.cpu.packed_linear import PackedWeights
from lookahead.models.gguf_blocks import UNPACKERS, integer_form
from lookahead.models.gguf_file import GGUFError
from lookahead.models.loading import apply_execution_path, load_model
from lookahead.models.quantized_embedding import QuantizedEmbedding
from tests.gguf_files import CHAT_TEMPLATE, EOS, K_TYPES, QUANTISABLE, Q, random_blocks, write_gguf
from tests.helpers import CPU_VARIANTS, plain_greedy

# In these int4 forms an offset turns gguf's -0.0 (d * 0 for a negative d) into +0.0 (gguf_blocks.py).
ZERO_SIGN_ONLY = (Q.Q4_0, Q.Q3_K)
PROMPT = [1, 5, 7, 200, 33, 10, 7, 200, 33]


@pytest.fixture(autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Converted tokenizers in a cache of this test session's own."""
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "model-cache"))


def blocks_of(qtype: Q, rows: int = 24, inputs: int = 512, seed: int = 0) -> np.ndarray:
    if qtype in K_TYPES:
        return random_blocks(qtype, rows, inputs, seed)
    weights = np.random.default_rng(seed).standard_normal((rows, inputs)).astype(np.float32) * 0.05
    weights[:, :40] = 0.0  # whole blocks of zeros, and zeros among others
    weights[::3, 50] = 0.0
    return quantize(weights, qtype)


def rebuilt(form) -> torch.Tensor:
    """fl(d * q + m) per weight, as the kernel's fused multiply-add computes it: the float64 sum is
    exact (asserted), so rounding it once to fp32 is the fma's one rounding."""
    d = form.d.double().repeat_interleave(form.group, dim=1)
    m = form.m.double().repeat_interleave(form.group, dim=1)
    product = d * form.q.double()
    total = product + m
    assert bool((((total - product) == m) & ((total - m) == product)).all())
    return total.float()


@pytest.mark.parametrize("qtype", list(UNPACKERS), ids=lambda q: q.name)
def test_integer_forms_rebuild_ggufs_dequantisation_bit_for_bit(qtype: Q) -> None:
    blocks = blocks_of(qtype)
    expected = torch.from_numpy(dequantize(blocks, qtype))
    form = integer_form(blocks, qtype)
    assert form.group in (16, 32) and form.q.dtype == torch.int8
    got = rebuilt(form)
    same_bits = got.view(torch.int32) == expected.view(torch.int32)
    assert torch.equal(got, expected)  # every value
    if qtype in ZERO_SIGN_ONLY:
        assert bool((got[~same_bits] == 0).all())
        assert bool((form.q >= 0).all() and (form.q <= 15).all())  # kept in the int4 form
    else:
        assert bool(same_bits.all())  # every bit, signed zeros included


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q3_K], ids=lambda q: q.name)
@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_the_kernel_multiplies_by_a_form_as_by_its_dequantised_weights(qtype: Q, variant) -> None:
    extension = load_extension(variant)
    blocks = blocks_of(qtype, rows=40, inputs=256, seed=3)
    form = integer_form(blocks, qtype)
    empty = nn.Linear(256, 40, bias=False, device="meta")
    dense = nn.Linear(256, 40, bias=False)
    dense.weight.data = torch.from_numpy(dequantize(blocks, qtype))
    from_form = PackedWeights([empty], extension, {empty: lambda: form})
    from_weights = PackedWeights([dense], extension, {dense: None})
    assert from_form.form in ("int4", "int8") and from_weights.form == "fp32"
    x = torch.randn(7, 256)
    assert torch.equal(from_form.product(x), from_weights.product(x))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_scales_keep_the_files_factors_exactly(qtype: Q) -> None:
    form = integer_form(blocks_of(qtype), qtype)
    factors = form.factors
    assert factors.d_super.dtype == torch.float16 and factors.d_sub.dtype == torch.int8
    assert factors.d_super.shape == (24, 512 // 256) and factors.d_sub.shape == form.d.shape
    pairs = ((factors.d_super, factors.d_sub, form.d), (factors.m_super, factors.m_sub, form.m))
    for super_, sub, whole in pairs:
        assert torch.equal(super_.float().repeat_interleave(256 // form.group, dim=1) * sub.float(), whole)
    assert integer_form(blocks_of(Q.Q5_0), Q.Q5_0).factors is None


def without_factors(form) -> IntegerForm:
    return IntegerForm(form.q, form.d, form.m, form.group)


@pytest.mark.parametrize(
    ("qtypes", "packed_as"),
    [((Q.Q5_0,), "int5"), ((Q.Q4_K,), "int4"), ((Q.Q6_K,), "int6"), ((Q.Q4_K, Q.Q6_K), "int6")],
    ids=lambda v: "+".join(q.name for q in v) if isinstance(v, tuple) else v,
)
@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_the_integer_kernel_keeps_a_files_bits_and_scale_factors(
    qtypes: tuple[Q, ...], packed_as: str, variant
) -> None:
    """With int8 activations a file's forms take as few bits as hold their integers and keep the
    K-quants' factored scales (fused siblings too), and compute what their multiplied-out scales do."""
    extension = load_extension(variant)
    forms = [integer_form(blocks_of(q, rows=40, inputs=512, seed=3 + i), q) for i, q in enumerate(qtypes)]
    empties = [nn.Linear(512, 40, bias=False, device="meta") for _ in forms]
    with_factors = {e: (lambda f=f: f) for e, f in zip(empties, forms)}
    factored = PackedWeights(empties, extension, with_factors, activations="int8")
    stripped = {e: (lambda f=f: without_factors(f)) for e, f in zip(empties, forms)}
    plain = PackedWeights(empties, extension, stripped, activations="int8")
    assert (factored.form, factored.activations) == (packed_as, "int8")
    k_quants = all(qtype in (Q.Q4_K, Q.Q6_K) for qtype in qtypes)
    assert hasattr(factored, "d_super_packed") == k_quants and not hasattr(plain, "d_super_packed")
    if k_quants:
        assert factored.streamed_bytes() < plain.streamed_bytes()
    x = torch.randn(13, 512)
    assert torch.equal(factored.product(x), plain.product(x))


ARCHITECTURE_TYPES = [
    ("llama", Q.Q4_K),
    ("mistral", Q.Q4_0),
    ("qwen2", Q.Q6_K),
    ("qwen3", Q.Q5_K),
    ("phi3", Q.Q8_0),
    ("gemma2", Q.Q4_1),
    ("gemma3", Q.Q3_K),
    *[("llama", qtype) for qtype in (*QUANTISABLE, Q.Q2_K, Q.Q5_1)],
]


def reference(path: Path) -> nn.Module:
    """transformers' own model of the file: every weight dequantised to fp32."""
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def logits(model: nn.Module, tokens: list[int] = PROMPT) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits


@pytest.mark.parametrize(("architecture", "qtype"), ARCHITECTURE_TYPES, ids=lambda v: getattr(v, "name", v))
def test_a_gguf_file_runs_as_transformers_runs_it(tmp_path: Path, architecture: str, qtype: Q) -> None:
    path = write_gguf(tmp_path / f"tiny-{architecture}.gguf", architecture, qtype)
    expected = reference(path)
    stock = load_model(str(path), linear_kernel="stock")
    assert type(stock.model) is type(expected)
    assert torch.equal(logits(stock.model), logits(expected))  # the exact fp32 path: the same weights
    weights = expected.state_dict()
    for name, parameter in stock.model.named_parameters():
        assert torch.equal(parameter, weights[name]), name
    ids = torch.arange(expected.config.vocab_size)
    assert torch.equal(stock.model.get_input_embeddings()(ids), expected.get_input_embeddings()(ids))
    packed = load_model(str(path), linear_kernel="packed")
    apply_execution_path(expected, "packed")  # its fp32 weights packed (integer forms searched)
    assert torch.equal(logits(packed.model), logits(expected))


def test_a_compact_model_holds_no_fp32_copy_of_its_quantised_weights(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", Q.Q4_K, embedding_type=Q.Q6_K)
    loaded = load_model(str(path), linear_kernel="packed")
    model = loaded.model
    assert isinstance(model.get_input_embeddings(), QuantizedEmbedding)
    assert not any(type(module) is nn.Linear for module in model.modules())
    assert {m.form for m in model.modules() if isinstance(m, PackedWeights)} == {"int4", "int8"}
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    norms = hidden * (2 * layers + 1)
    assert sum(p.numel() for p in model.parameters()) == norms  # no weight matrix in fp32
    biases = sum(
        m.bias.numel() for m in model.modules() if isinstance(m, PackedWeights) and m.bias is not None
    )
    assert biases == layers * (hidden + 2 * 128)  # q, k and v's
    assert "lean layers" in loaded.execution


def test_an_embedding_keeps_the_rows_it_dequantised_within_its_bound_with_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", Q.Q4_K, embedding_type=Q.Q6_K)
    embedding = load_model(str(path), linear_kernel="packed").model.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding)
    table = torch.from_numpy(dequantize(embedding.rows.numpy(), embedding.qtype))
    calls = []
    monkeypatch.setattr(
        "lookahead.models.quantized_embedding.dequantize",
        lambda rows, qtype: calls.append(len(rows)) or dequantize(rows, qtype),
    )
    embedding._capacity = 4
    ids = torch.tensor([[3, 9, 3, 200]])
    assert torch.equal(embedding(ids), table[ids])
    assert torch.equal(embedding(ids[:, :2]), table[ids[:, :2]])  # found: no call
    assert calls == [3]
    assert torch.equal(embedding(torch.tensor([7, 8, 3])), table[[7, 8, 3]])
    assert calls == [3, 2] and list(embedding._dequantized) == [9, 200, 7, 8]  # the oldest, 3, dropped
    assert torch.equal(embedding(torch.arange(10)[None]), table[None, :10])  # more than it keeps
    assert len(embedding._dequantized) == 4
    assert all(row.base is None for row in embedding._dequantized.values())  # copies, not views
    assert embedding(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, table.shape[1])


def test_mixed_block_types_share_one_packed_matrix(tmp_path: Path) -> None:
    """As in a Q4_K_M file: v and down in Q6_K (groups of 16, int8), q, k, gate, up in Q4_K."""
    overrides = {f"blk.{i}.{name}.weight": Q.Q6_K for i in range(2) for name in ("attn_v", "ffn_down")}
    path = write_gguf(tmp_path / "mixed.gguf", "llama", Q.Q4_K, embedding_type=Q.Q6_K, overrides=overrides)
    loaded = load_model(str(path), linear_kernel="packed")
    attention = loaded.model.model.layers[0].self_attn
    assert attention.q_proj.weights is attention.v_proj.weights
    assert attention.q_proj.weights.form == "int8"
    assert "lean layers" in loaded.execution
    expected = reference(path)
    apply_execution_path(expected, "packed")
    assert torch.equal(logits(loaded.model), logits(expected))


def test_an_unpackable_type_beside_packed_ones_keeps_its_own_matrix(tmp_path: Path) -> None:
    overrides = {f"blk.{i}.attn_v.weight": Q.IQ4_NL for i in range(2)}
    path = write_gguf(tmp_path / "iq.gguf", "llama", Q.Q4_K, overrides=overrides)
    loaded = load_model(str(path), linear_kernel="packed")
    attention = loaded.model.model.layers[0].self_attn
    assert attention.v_proj.weights.form == "fp32" and attention.q_proj.weights.form == "int4"
    assert attention.q_proj.weights is not attention.v_proj.weights  # q/k/v packed apart
    assert "transformers' layers" in loaded.execution
    expected = reference(path)
    apply_execution_path(expected, "packed")
    assert torch.equal(logits(loaded.model), logits(expected))


def test_lookahead_decodes_a_gguf_model_as_plain_greedy_decoding(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", "llama", Q.Q4_K)
    loaded = load_model(str(path), linear_kernel="packed")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = PROMPT * 3
    plain, _ = LookaheadDecoder.for_model(loaded, None, LookaheadConfig(use_lookahead=False)).generate(
        prompt, params
    )
    drafted, stats = LookaheadDecoder.for_model(loaded, NGramTrie(10000, 8), LookaheadConfig()).generate(
        prompt, params
    )
    assert drafted == plain and stats.draft_tokens > 0
    stock = load_model(str(path), linear_kernel="stock")  # the exact fp32 path
    exact, _ = LookaheadDecoder.for_model(stock, NGramTrie(10000, 8)).generate(prompt, params)
    expected = reference(path)
    expected.generation_config.eos_token_id = None  # as ignore_eos
    assert exact == plain_greedy(expected, prompt, 24)


def test_the_tokenizer_and_chat_template_come_from_the_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", Q.Q8_0)
    loaded = load_model(str(path))
    tokenizer = loaded.tokenizer
    assert tokenizer.encode("héllo") == list("héllo".encode())
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<user>hi\n<assistant>"
    )
    assert EOS in loaded.eos_token_ids and loaded.name == "tiny.gguf"
    from lookahead.models import gguf_file

    monkeypatch.setattr(gguf_file.GGUFModelFile, "_from_file", lambda *a: pytest.fail("converted again"))
    assert load_model(str(path)).fingerprint == loaded.fingerprint


def truncated(path: Path, keep: int) -> Path:
    path.write_bytes(path.read_bytes()[:keep])
    return path


def written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def folder(path: Path) -> Path:
    path.mkdir()
    return path


BAD_FILES = {
    "missing": (lambda p: p, 2, r"{path}: no such GGUF file"),
    "directory": (folder, 1, r"{path} is a directory, not a GGUF file"),
    "wrong magic": (
        lambda p: written(p, b"PK\x03\x04 a zip file"),
        1,
        r"{path} is not a GGUF file \(it starts with b'PK\\x03\\x04', not b'GGUF'\)",
    ),
    "truncated header": (
        lambda p: truncated(write_gguf(p, "llama", Q.Q8_0), 200),
        1,
        r"{path} is not a readable GGUF file: it is truncated: its header needs bytes up to \d+, "
        r"the file has 200 bytes",
    ),
    "truncated tensors": (
        lambda p: truncated(write_gguf(p, "llama", Q.Q8_0), -1000),
        1,
        r"{path} is not a readable GGUF file: it is truncated: tensor \S+ ends at byte \d+, the file has",
    ),
    "unsupported architecture": (
        lambda p: write_gguf(p, "llama", Q.Q8_0, architecture="bert"),
        1,
        r"{path}: architecture 'bert' is not one this server loads from GGUF \(llama, mistral, qwen2",
    ),
    "unsupported tensor type": (
        lambda p: write_gguf(p, "llama", Q.Q8_0, overrides={"blk.0.attn_q.weight": Q.Q8_K}),
        1,
        r"{path}: tensor blk.0.attn_q.weight has type Q8_K, which this server cannot read",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_gets_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture, case: str) -> None:
    make, status, message = BAD_FILES[case]
    path = make(tmp_path / "model.gguf")
    pattern = message.format(path=re.escape(str(path)))
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2"]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert re.search(pattern, err), err
    with pytest.raises((GGUFError, FileNotFoundError), match=pattern):
        load_model(str(path))
