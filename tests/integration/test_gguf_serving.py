"""A GGUF file by path through a real tritonserver: served as the library decodes it, and a bad one
refused at load with one line naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gguf import GGUFValueType

from launcher import TritonServer, TritonServerError
from lookahead import LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.models.loading import load_model
from tests.gguf_files import Q, write_gguf
from tests.integration.servers import copy_repository, launch, set_parameter
from tests.integration.test_server import generate

PROMPT = "hello, hello, hello"


def repository_serving(root: Path, model: Path) -> Path:
    repository = copy_repository(root / "repository", root / "state", ("lookahead",))
    config = repository / "lookahead" / "config.pbtxt"
    config.write_text(set_parameter(config.read_text(), "model", str(model)))
    return repository


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_K.gguf", "llama", Q.Q4_K)


@pytest.fixture(scope="module")
def server(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("gguf-server")
    with launch(repository_serving(root, gguf), root / "server.log") as running:
        yield running


def test_a_gguf_file_is_served_as_the_library_decodes_it(server: TritonServer, gguf: Path) -> None:
    loaded = load_model(str(gguf))
    decoder = LookaheadDecoder.for_model(loaded, NGramTrie(10000, 8))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = "".join(out.text for out in decoder.stream(loaded.tokenizer.encode(PROMPT), params))
    body = {
        "text_input": PROMPT,
        "exclude_input_in_output": True,
        "return_num_output_tokens": True,
        "parameters": {"max_tokens": 16, "ignore_eos": True, "temperature": 0},
    }
    reply = generate(server, "lookahead", body)
    assert reply["text_output"] == expected
    assert reply["num_output_tokens"] == 16


def test_a_truncated_gguf_file_fails_the_load_with_one_line_naming_it(gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(gguf.read_bytes()[:-1000])
    with pytest.raises(TritonServerError, match="exited with code"):
        launch(repository_serving(tmp_path, bad), tmp_path / "server.log")
    lines = (tmp_path / "server.log").read_text().splitlines()
    message = (
        f"lookahead_0_0: cannot serve '{bad}': {bad} is not a readable GGUF file: it is truncated: "
        "tensor output_norm.weight ends at byte"
    )
    logged = [line for line in lines if message in line]
    assert logged and logged[0].startswith("E"), lines  # logged as an error, on its own line
    assert not any("gguf_file.py" in line or "Traceback" in line for line in lines)


def test_a_gguf_file_whose_chat_template_cannot_render_fails_the_load_with_one_line(tmp_path: Path) -> None:
    bad = write_gguf(
        tmp_path / "template.gguf",
        "llama",
        Q.Q8_0,
        metadata={"tokenizer.chat_template": ("{% include 'secrets.txt' %}", GGUFValueType.STRING)},
    )
    with pytest.raises(TritonServerError, match="exited with code"):
        launch(repository_serving(tmp_path, bad), tmp_path / "server.log")
    lines = (tmp_path / "server.log").read_text().splitlines()
    message = (
        f"lookahead_0_0: cannot serve '{bad}': {bad}: tokenizer.chat_template cannot render a conversation "
        "(TypeError: no loader for this environment specified)"
    )
    logged = [line for line in lines if message in line]
    assert logged and logged[0].startswith("E"), lines
    assert not any("Traceback" in line for line in lines)
