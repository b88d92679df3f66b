"""Starting real tritonservers on copies of the shipped model repository (for the integration tests)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from launcher import TritonServer, free_port, start_server

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
MAX_PROMPT_TOKENS = 256  # lowered in the test copy so that an over-long prompt stays cheap to build


def copy_repository(
    target: Path, state_dir: Path, models: tuple[str, ...], instances: int = 1, warmup_corpus: str = ""
) -> Path:
    """A copy of the shipped repository whose tries live in state_dir."""
    for model in models:
        shutil.copytree(REPOSITORY / model, target / model)
        config = target / model / "config.pbtxt"
        text = set_parameter(config.read_text(), "max_prompt_tokens", str(MAX_PROMPT_TOKENS))
        if '"trie_state_dir"' in text:  # the baseline keeps no trie
            text = set_parameter(text, "trie_state_dir", str(state_dir))
            text = set_parameter(text, "warmup_corpus", warmup_corpus)
        text, replaced = re.subn(r"^(\s+count:) \d+$", rf"\1 {instances}", text, flags=re.MULTILINE)
        assert replaced == 1
        config.write_text(text)
    return target


def set_parameter(config: str, key: str, value: str) -> str:
    pattern = rf'(\{{ key: "{key}", value: \{{ string_value: )"[^"]*"'
    config, replaced = re.subn(pattern, rf'\1"{value}"', config)
    assert replaced == 1, f"parameter {key} not found"
    return config


# A loaded 2-core machine can take minutes to load two instances (the launcher's own default).
READY_TIMEOUT_S = 600.0


def launch(
    repository: Path, log_file: Path, ready_timeout_s: float = READY_TIMEOUT_S, **options: Any
) -> TritonServer:
    """tritonserver on `repository` with fresh ports, its output in `log_file`; `options` go to
    launcher.start_server (extra_args, extra_env)."""
    return start_server(
        repository,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        log_file=log_file,
        ready_timeout_s=ready_timeout_s,
        **options,
    )
