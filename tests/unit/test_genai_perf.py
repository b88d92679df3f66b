"""genai-perf counts tokens with the tokenizer of the model the server really serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.launcher import MODEL_ENV
from client.genai_perf import served_tokenizer

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def hf_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_the_config_pbtxt_model_parameter_names_the_tokenizer(tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    repository = tmp_path / "repository"
    (repository / "lookahead").mkdir(parents=True)
    folder = hf_folder(tmp_path / "my-model")
    (repository / "lookahead" / "config.pbtxt").write_text(
        f'parameters [\n  {{ key: "model", value: {{ string_value: "{folder}" }} }}\n]\n'
    )
    assert served_tokenizer(repository, "lookahead") == folder


def test_lookahead_model_replaces_the_config_pbtxt_model_as_it_does_in_the_server(tmp_path, monkeypatch):
    folder = hf_folder(tmp_path / "served")
    monkeypatch.setenv(MODEL_ENV, str(folder))
    assert served_tokenizer(REPOSITORY, "baseline") == folder
    monkeypatch.setenv(MODEL_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="neither an embedded model"):
        served_tokenizer(REPOSITORY, "lookahead")
