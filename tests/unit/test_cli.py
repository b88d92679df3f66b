"""`python -m lookahead generate`: token ids and text out, one-line errors with their exit status."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from lookahead.cli import main
from lookahead.models.chat import apply_chat_template
from tests.helpers import plain_greedy

CHATGLM = Path(__file__).resolve().parents[1] / "data" / "chatglm3-tiny"
REFERENCE = json.loads((CHATGLM / "reference.jsonl").read_text().splitlines()[3])


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def ids_argument(ids: list[int]) -> str:
    return ",".join(map(str, ids))


@pytest.mark.parametrize("lookahead", [[], ["--no-lookahead"]])
def test_prompt_ids_give_the_reference_tokens_as_json(capsys, lookahead: list[str]) -> None:
    status, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        str(CHATGLM),
        "--prompt-ids",
        ids_argument(REFERENCE["prompt_ids"]),
        "--max-tokens",
        "48",
        "--ignore-eos",
        "--json",
        *lookahead,
    )
    assert status == 0
    result = json.loads(out.splitlines()[-1])
    assert result["token_ids"] == REFERENCE["greedy_ids"]
    assert "text" not in result  # the folder has no tokenizer
    assert result["stats"]["output_tokens"] == 48 and result["finish_reason"] == "length"
    assert (result["stats"]["draft_tokens"] > 0) == (not lookahead)


def test_without_json_the_ids_stream_and_stats_go_to_stderr(capsys) -> None:
    status, out, err = run_cli(
        capsys,
        "generate",
        "--model",
        str(CHATGLM),
        "--prompt-ids",
        ids_argument(REFERENCE["prompt_ids"]),
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--decoding-mode",
        "one",
        "--stats",
    )
    assert status == 0
    assert out.split() == [str(token) for token in REFERENCE["greedy_ids"][:12]]
    assert err.startswith("12 tokens in ") and "finish length" in err


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--model", "/no/such/model", "--prompt", "x"], 2, "'/no/such/model' is neither an embedded model"),
        (
            ["--model", str(CHATGLM), "--prompt-ids", "5,256"],
            2,
            r"prompt ids \[256\] are outside the vocabulary",
        ),
        (
            ["--model", str(CHATGLM), "--prompt-ids", "5,x"],
            2,
            "--prompt-ids must be comma-separated integers",
        ),
        (["--model", str(CHATGLM), "--prompt", "hello"], 2, "has no tokenizer: give --prompt-ids"),
    ],
)
def test_errors_are_one_line_with_their_exit_status(
    capsys, argv: list[str], status: int, message: str
) -> None:
    code, out, err = run_cli(capsys, "generate", *argv)
    assert code == status
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert re.search(message, err)


def test_an_unknown_architecture_is_refused_in_one_line(capsys, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_own_lm", "auto_map": {}}))
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt-ids", "1,2")
    assert code == 1
    assert err == (
        f"error: model folder {tmp_path}: architecture 'my_own_lm' is not implemented by transformers "
        f"{transformers.__version__} (code shipped in a model folder is never run)\n"
    )


def test_bad_numbers_are_refused_by_argparse(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--max-tokens", "0"])
    assert exit_info.value.code == 2
    assert "--max-tokens: expected a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_the_default_model_answers_a_chat_prompt_as_json(capsys, default_model) -> None:
    status, out, _ = run_cli(
        capsys,
        "generate",
        "--prompt",
        "What is the capital of Japan?",
        "--chat",
        "--max-tokens",
        "12",
        "--json",
    )
    assert status == 0
    result = json.loads(out.splitlines()[-1])
    assert result["text"] == "The capital of Japan is Tokyo."  # no near-tie on either CPU path
    prompt = apply_chat_template(default_model.tokenizer, "What is the capital of Japan?")
    assert result["token_ids"] == plain_greedy(default_model.model, prompt, 12)
    assert result["finish_reason"] == "stop"


def test_python_m_lookahead_runs_the_cli() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lookahead",
            "generate",
            "--model",
            str(CHATGLM),
            "--prompt-ids",
            "5,6,7",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout.splitlines()[-1])["token_ids"]) == 3


def test_prepare_readies_the_default_model_unless_told_others(capsys, monkeypatch) -> None:
    import lookahead.cli as cli

    prepared: list[str] = []
    monkeypatch.setattr(cli, "prepare_gguf", lambda name: prepared.append(name) or f"/cache/{name}.gguf")
    monkeypatch.setattr(cli, "prepare_integer_forms", lambda name: pytest.fail("a GGUF model was searched"))
    assert main(["prepare"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smollm2-135m-instruct: /cache/smollm2-135m-instruct.gguf\n")
    assert main(["prepare", "qwen2.5-coder-0.5b-instruct"]) == 0
    assert prepared == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
