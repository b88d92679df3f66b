"""config.pbtxt parameters -> BackendConfig, without Triton."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.config import PROJECT_ROOT, BackendConfig, parse_parameters
from lookahead.config import DecoderConfig, LookaheadConfig, TrieConfig
from lookahead.contract import STATE_DIR_ENV
from lookahead.models.embedded import DEFAULT_MODEL
from tests.helpers import pbtxt_parameters

MODEL_REPOSITORY = PROJECT_ROOT / "model_repository"


def parse(tmp_path: Path, **parameters: str) -> BackendConfig:
    return parse_parameters(parameters, model_dir=tmp_path / "repo" / "lookahead", model_name="lookahead")


def test_unset_parameters_take_the_defaults(tmp_path):
    config = parse(tmp_path)
    assert config.model == DEFAULT_MODEL
    assert (config.dtype, config.device, config.threads) == ("float32", "cpu", 0)
    assert config.linear_kernel == "auto"
    assert config.lookahead == LookaheadConfig()
    assert config.trie_state_dir == PROJECT_ROOT / ".state" / "lookahead"
    assert config.warmup_corpus is None
    assert config.snapshot_interval_s == 60.0
    assert config.report_custom_metrics is True
    assert config.trie == TrieConfig()
    assert config.decoder == DecoderConfig()


@pytest.mark.parametrize("unset", ["", "   ", "${decoding_length}"])
def test_empty_and_template_placeholders_mean_unset(tmp_path, unset):
    assert (
        parse(tmp_path, decoding_length=unset).lookahead.decoding_length == LookaheadConfig().decoding_length
    )


def test_values_are_parsed_by_type(tmp_path):
    config = parse(
        tmp_path,
        use_lookahead="False",
        decoding_length="16",
        branch_length="4",
        decoding_mode="one",
        max_query_length="3",
        adaptive="no",
        trie_capacity="5000",
        trie_depth="7",
        snapshot_interval_s="2.5",
        threads="1",
        dtype="bfloat16",
        device="cuda:1",
        linear_kernel="stock",
        max_prompt_tokens="100",
        max_output_tokens="20",
        REPORT_CUSTOM_METRICS="FALSE",
        prefix_cache_tokens="0",
        kv_cache_dtype="float16",
    )
    assert config.lookahead == LookaheadConfig(
        use_lookahead=False,
        decoding_length=16,
        branch_length=4,
        decoding_mode="one",
        max_query_length=3,
        adaptive=False,
    )
    assert (config.trie.capacity, config.snapshot_interval_s, config.threads) == (5000, 2.5, 1)
    assert (config.dtype, config.device, config.linear_kernel) == ("bfloat16", "cuda:1", "stock")
    assert (config.max_prompt_tokens, config.max_output_tokens, config.report_custom_metrics) == (
        100,
        20,
        False,
    )
    assert config.trie.depth == 7
    assert config.decoder.kv_cache_dtype == "float16"
    assert config.decoder.prefix_cache_tokens == 0


def test_relative_paths_resolve_against_the_model_repository(tmp_path):
    config = parse(tmp_path, trie_state_dir="state/lookahead", warmup_corpus="corpora/code.jsonl")
    assert config.trie_state_dir == (tmp_path / "repo" / "state" / "lookahead").resolve()
    assert config.warmup_corpus == (tmp_path / "repo" / "corpora" / "code.jsonl").resolve()
    assert parse(tmp_path, trie_state_dir=str(tmp_path / "abs")).trie_state_dir == tmp_path / "abs"


def test_gpu_instances_default_to_their_device(tmp_path):
    model_dir = tmp_path / "repo" / "lookahead"
    gpu = parse_parameters({}, model_dir=model_dir, model_name="m", instance_kind="GPU", instance_device_id=2)
    assert gpu.device == "cuda:2"
    pinned = parse_parameters(
        {"device": "cpu"}, model_dir=model_dir, model_name="m", instance_kind="GPU", instance_device_id=2
    )
    assert pinned.device == "cpu"


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("decoding_length", "0", "must be >= 1, got 0"),
        ("decoding_length", "many", "expected an integer, got 'many'"),
        ("branch_length", "-1", "must be >= 0, got -1"),
        ("decoding_mode", "tree", "decoding_mode must be one of hier, par, one, got 'tree'"),
        ("max_query_length", "0", "must be >= 1"),
        ("use_lookahead", "maybe", "expected true or false, got 'maybe'"),
        ("REPORT_CUSTOM_METRICS", "yes please", "expected true or false"),
        ("trie_capacity", "0", "must be >= 1"),
        ("snapshot_interval_s", "-5", "must be >= 0.0, got -5.0"),
        ("snapshot_interval_s", "nan", "must be >= 0.0"),
        ("threads", "-1", "must be >= 0"),
        ("dtype", "int8", "expected one of float32, bfloat16, float16, got 'int8'"),
        ("linear_kernel", "fast", "expected one of auto, integer, packed, stock, got 'fast'"),
        ("device", "tpu", "expected cpu, cuda or cuda:<index>, got 'tpu'"),
        ("device", "cpu:0", "expected cpu, cuda or cuda:<index>"),
        ("max_prompt_tokens", "-1", "must be >= 0, got -1"),
        ("max_output_tokens", "1.5", "expected an integer, got '1.5'"),
        ("prefix_cache_tokens", "-1", "must be >= 0, got -1"),
        ("kv_cache_dtype", "bfloat16", "expected one of model, float16, got 'bfloat16'"),
    ],
)
def test_invalid_values_name_the_parameter(tmp_path, name, value, problem):
    with pytest.raises(ValueError) as raised:
        parse(tmp_path, **{name: value})
    assert str(raised.value).startswith(f"config.pbtxt parameter {name!r}: ")
    assert problem in str(raised.value)


def test_the_trie_must_hold_one_full_ngram(tmp_path):
    with pytest.raises(ValueError, match=r"parameter 'trie_capacity': must be >= trie_depth \(7\)"):
        parse(tmp_path, trie_capacity="6", trie_depth="7")
    assert parse(tmp_path, trie_capacity="7", trie_depth="7").trie.capacity == 7


@pytest.mark.parametrize("depth", ["4", "128"])
def test_the_trie_must_be_deeper_than_a_query(tmp_path, depth):
    with pytest.raises(
        ValueError, match=r"parameter 'trie_depth': must be > max_query_length \(4\) and <= 127"
    ):
        parse(tmp_path, trie_depth=depth, max_query_length="4")


def test_unknown_parameters_fail_the_load_but_other_backends_keys_do_not(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"^unknown config.pbtxt parameters: 'decoding_lenght' \(did you mean 'decoding_length'\?\), "
        r"'zzz'$",
    ):
        parse(tmp_path, decoding_lenght="8", zzz="1", EXECUTION_ENV_PATH="$$TRITON_MODEL_DIRECTORY/env")
    config = parse(
        tmp_path,
        EXECUTION_ENV_PATH="$$TRITON_MODEL_DIRECTORY/env",
        FORCE_CPU_ONLY_INPUT_TENSORS="no",
        ENABLE_VLLM_HEALTH_CHECK="true",
        REPORT_CUSTOM_METRICS="false",
    )
    assert config.report_custom_metrics is False


def test_from_triton_args_reads_the_model_config_json(tmp_path):
    model_config = {"name": "lookahead", "parameters": {"branch_length": {"string_value": "6"}}}
    args = {
        "model_config": json.dumps(model_config),
        "model_repository": str(tmp_path / "repo" / "lookahead"),
        "model_name": "lookahead",
        "model_instance_kind": "GPU",
        "model_instance_device_id": "1",
    }
    config = BackendConfig.from_triton_args(args)
    assert config.lookahead.branch_length == 6
    assert config.device == "cuda:1"


@pytest.mark.parametrize(("model", "use_lookahead"), [("lookahead", True), ("baseline", False)])
def test_shipped_configs_parse_without_unknown_parameters(model, use_lookahead):
    config = parse_parameters(pbtxt_parameters(model), model_dir=MODEL_REPOSITORY / model, model_name=model)
    assert config.lookahead.use_lookahead is use_lookahead
    assert config.model == DEFAULT_MODEL
    assert config.trie_state_dir == PROJECT_ROOT / ".state" / model


def test_the_state_folder_of_unset_trie_state_dirs_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "states"))
    assert parse(tmp_path).trie_state_dir == tmp_path / "states" / "lookahead"
    assert parse(tmp_path, trie_state_dir="mine").trie_state_dir == (tmp_path / "repo" / "mine").resolve()


@pytest.mark.parametrize("model", ["lookahead", "baseline"])
def test_lookahead_model_replaces_every_models_model_parameter(model, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_MODEL", "qwen2.5-coder-0.5b-instruct")
    config = parse_parameters(pbtxt_parameters(model), model_dir=MODEL_REPOSITORY / model, model_name=model)
    assert config.model == "qwen2.5-coder-0.5b-instruct"


def test_stop_words_are_a_json_list_of_strings_and_ids(tmp_path):
    config = parse(tmp_path, stop_words='[",", " ", 13]', debug="true")
    assert config.lookahead.stop_words == (",", " ", 13) and config.lookahead.debug
    with pytest.raises(ValueError, match="'stop_words': expected a JSON list of strings and token ids"):
        parse(tmp_path, stop_words=",")
