"""Crafted GGUF files: each is refused within seconds, in one line naming the file and the field,
without a traceback and without memory beyond twice the file's size."""

from __future__ import annotations

import re
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType as V

from launcher import TritonServerError
from launcher import cli as launcher_cli
from lookahead.cli import main
from lookahead.models.gguf_header import MAX_NESTING
from tests.gguf_files import Q, write_gguf

SECONDS = 10.0
OVERHEAD = 256 * 1024  # what the command allocates whatever the file (its arguments, its messages)
TEMPLATE = "tokenizer.chat_template cannot render a conversation"


def template(text: str, error: str) -> tuple[dict[str, Any], str]:
    return {"tokenizer.chat_template": (text, V.STRING)}, rf"{TEMPLATE} \({error}"


# name -> (metadata written instead of the model's, what the one line says after the file's name)
HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    "eos id 2^31": (
        {"tokenizer.ggml.eos_token_id": (2**31, V.UINT32)},
        r"tokenizer\.ggml\.eos_token_id is 2147483648, outside the vocabulary of 256 tokens",
    ),
    "negative bos id": (
        {"tokenizer.ggml.bos_token_id": (-1, V.INT32)},
        r"tokenizer\.ggml\.bos_token_id is -1, not a token id",
    ),
    "head_count 0": (
        {"llama.attention.head_count": (0, V.UINT32)},
        r"llama\.attention\.head_count is 0, not a positive integer up to 2147483647",
    ),
    "head_count as text": (
        {"llama.attention.head_count": ("four", V.STRING)},
        r"llama\.attention\.head_count is 'four', not a positive integer",
    ),
    "head_count not dividing the width": (
        {"llama.attention.head_count": (3, V.UINT32)},
        r"llama\.attention\.head_count 3 does not divide llama\.embedding_length 256",
    ),
    "head_count_kv not dividing head_count": (
        {"llama.attention.head_count_kv": (3, V.UINT32)},
        r"llama\.attention\.head_count_kv 3 does not divide llama\.attention\.head_count 4",
    ),
    "block_count 2^31": (
        {"llama.block_count": (2**31, V.UINT32)},
        r"llama\.block_count is 2147483648, not a positive integer up to 2147483647",
    ),
    "block_count 100,000": (
        {"llama.block_count": (100_000, V.UINT32)},
        r"llama\.block_count is 100000, but the file holds tensors of 2 blocks",
    ),
    "no block_count": ({"llama.block_count": None}, r"llama\.block_count is missing"),
    "scores shorter than the tokens": (
        {"tokenizer.ggml.scores": ([0.0] * 10, V.ARRAY)},
        r"tokenizer\.ggml\.scores has 10 entries, tokenizer\.ggml\.tokens 256",
    ),
    "tokens as one string": (
        {"tokenizer.ggml.tokens": ("abc", V.STRING)},
        r"tokenizer\.ggml\.tokens is 'abc', not an array of STRING",
    ),
    "a merge into no token": (
        {"tokenizer.ggml.merges": (["Ā ā"], V.ARRAY)},
        r"tokenizer\.ggml\.merges\[0\] 'Ā ā' does not join two tokens into a token",
    ),
    "a merge of unknown tokens": (
        {"tokenizer.ggml.merges": (["zz qq"], V.ARRAY)},
        r"tokenizer\.ggml\.merges\[0\] 'zz qq' does not join two tokens into a token",
    ),
    "a tokenizer model transformers lacks": (
        {"tokenizer.ggml.model": ("nonesuch", V.STRING)},
        r"its tokenizer cannot be built from its metadata \(\w+: .+",
    ),
    "template syntax error": template("{% for %}", "TemplateSyntaxError: "),
    "template raise": template("{{ raise_exception('refused') }}", "TemplateError: refused"),
    "template __class__": template(
        "{{ messages.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'"
    ),
    "template __init__": template(
        "{{ messages.__init__.__globals__ }}", "SecurityError: access to attribute '__init__'"
    ),
    "template include": template("{% include 'secrets.txt' %}", "TypeError: no loader"),
    "template import": template("{% import 'os' as os %}{{ os }}", "TypeError: no loader"),
    "template recursion": template(
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError: maximum recursion depth"
    ),
}


def nested_arrays(path: Path, depth: int) -> Path:
    """A GGUF header whose one metadata value is an array of an array of ... `depth` deep."""
    key = b"deep"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<I", V.ARRAY) + struct.pack("<IQ", V.ARRAY, 1) * (depth - 1)
    data += struct.pack("<IQ", V.UINT8, 0)
    path.write_bytes(data)
    return path


@pytest.fixture(autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "model-cache"))


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One good file loaded first: imports and lazy initialisation are not the hostile file's."""
    good = write_gguf(tmp_path_factory.mktemp("good") / "good.gguf", "llama", Q.Q8_0)
    assert main(["generate", "--model", str(good), "--prompt-ids", "1,2", "--max-tokens", "1", "--json"]) == 0


def refused_in_one_line(path: Path, capsys: pytest.CaptureFixture) -> str:
    """Run `generate --model path`: the one line it ends with, checked for time and memory."""
    capsys.readouterr()
    tracemalloc.start()
    started = time.monotonic()
    try:
        status = main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-tokens", "1"])
        seconds = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert status == 1, err
    assert seconds < SECONDS
    size = path.stat().st_size
    assert peak < 2 * size + OVERHEAD, f"{peak} bytes at the peak, the file has {size}"
    assert err.count("\n") == 1 and err.startswith(f"error: {path}") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_file_is_refused_in_one_line_naming_it_and_the_field(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture, warm: None
) -> None:
    metadata, message = HOSTILE[case]
    path = write_gguf(tmp_path / "hostile.gguf", "llama", Q.Q8_0, metadata=metadata)
    err = refused_in_one_line(path, capsys)
    assert re.fullmatch(rf"error: {re.escape(str(path))}: {message}.*\n", err), err


def test_nested_arrays_are_refused_at_a_bounded_depth(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    deep = nested_arrays(tmp_path / "deep.gguf", 100_000)
    err = refused_in_one_line(deep, capsys)
    nesting = f"metadata deep nests arrays more than {MAX_NESTING} deep"
    assert err == f"error: {deep} is not a readable GGUF file: {nesting}\n"
    shallow = nested_arrays(tmp_path / "shallow.gguf", MAX_NESTING)  # parsed, then lacks an architecture
    assert "architecture '(none)'" in refused_in_one_line(shallow, capsys)


def test_the_launcher_refuses_a_hostile_file_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model` checks the metadata itself; the tokenizer and the template are checked by the
    `prepare` it runs, whose one line precedes the launcher's."""
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path / "cache"))
    heads = write_gguf(tmp_path / "heads.gguf", "llama", Q.Q8_0, metadata=HOSTILE["head_count 0"][0])
    refused = rf"^--model: {re.escape(str(heads))}: llama\.attention\.head_count is 0"
    with pytest.raises(TritonServerError, match=refused):
        launcher_cli.model_override(str(heads))
    bad = write_gguf(tmp_path / "template.gguf", "llama", Q.Q8_0, metadata=HOSTILE["template include"][0])
    capfd.readouterr()
    with pytest.raises(TritonServerError, match="python -m lookahead prepare: 1"):
        launcher_cli.model_override(str(bad))
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: {bad}: {TEMPLATE} (TypeError: no loader for this environment specified)"], err
    assert "Traceback" not in err
