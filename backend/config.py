"""Instance settings from config.pbtxt `parameters`, parsed once in `initialize`.

Triton hands every parameter over as a string. We parse them into one frozen dataclass so a
typo or a bad value fails the model load with a message naming the parameter, instead of
surfacing later as a broken request. "" and an unfilled "${...}" template placeholder (the
TensorRT-LLM `fill_template.py` convention) both mean "use the default".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from lookahead.config import LookaheadConfig
from lookahead.decoder import MAX_SPECULATIVE_BATCH, PREFIX_CACHE_TOKENS
from lookahead.models import DEFAULT_MODEL, DTYPES
from lookahead.packed_linear import LINEAR_KERNELS
from lookahead.trie import DEFAULT_MAX_DEPTH, MAX_DEPTH_LIMIT

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Folder holding each model's default trie_state_dir (<folder>/<model>); default <repo>/.state.
STATE_DIR_ENV = "LOOKAHEAD_STATE_DIR"
# Keys the Python backend itself reads; never reported as unknown.
_TRITON_RESERVED = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})

T = TypeVar("T")


@dataclass(frozen=True)
class BackendConfig:
    """Everything one model instance needs to load its model and serve requests.

    `lookahead` holds the instance defaults, which are also the maxima a request may ask for.
    """

    model: str
    dtype: str
    device: str
    threads: int
    linear_kernel: str
    lookahead: LookaheadConfig
    step_token_budget: int
    max_speculative_batch: int
    prefix_cache_tokens: int
    trie_capacity: int
    trie_depth: int
    trie_state_dir: Path
    snapshot_interval_s: float
    warmup_corpus: Path | None
    max_prompt_tokens: int
    max_output_tokens: int
    report_custom_metrics: bool
    ignored_parameters: tuple[str, ...] = ()  # set but read by nothing: most likely typos

    @classmethod
    def from_triton_args(cls, args: Mapping[str, str]) -> BackendConfig:
        """Parse the `args` dict Triton passes to `initialize`."""
        model_config = json.loads(args["model_config"])
        return parse_parameters(
            flatten_parameters(model_config.get("parameters", {})),
            model_dir=Path(args["model_repository"]),
            model_name=args["model_name"],
            instance_kind=args.get("model_instance_kind", "CPU"),
            instance_device_id=int(args.get("model_instance_device_id", 0) or 0),
        )


def flatten_parameters(raw: Mapping[str, Any]) -> dict[str, str]:
    """{"k": {"string_value": "v"}} (the model_config JSON form) -> {"k": "v"}."""
    return {name: value.get("string_value", "") for name, value in raw.items()}


def parse_parameters(
    parameters: Mapping[str, str],
    *,
    model_dir: Path,
    model_name: str,
    instance_kind: str = "CPU",
    instance_device_id: int = 0,
) -> BackendConfig:
    """Validate flat string parameters; raise ValueError naming the first bad parameter.

    Relative paths are resolved against the model repository (the folder holding the model's
    directory), so a repository can be moved or copied together with its state and corpora.
    """
    read = _Reader(parameters)
    repository = model_dir.resolve().parent
    state_root = Path(os.environ.get(STATE_DIR_ENV) or PROJECT_ROOT / ".state")
    state_dir = read("trie_state_dir", _path(repository), state_root / model_name)
    lookahead_fields = {
        name: read(name, parser, getattr(LookaheadConfig, name))
        for name, parser in (
            ("use_lookahead", _bool),
            ("decoding_length", _int(minimum=1)),
            ("branch_length", _int(minimum=0)),
            ("decoding_mode", str),
            ("max_query_length", _int(minimum=1)),
            ("adaptive", _bool),
        )
    }
    try:
        lookahead = LookaheadConfig(**lookahead_fields)
    except ValueError as error:
        raise ValueError(f"config.pbtxt parameter {_field_in(error, lookahead_fields)!r}: {error}") from None
    trie_depth = read("trie_depth", _int(minimum=2), DEFAULT_MAX_DEPTH)
    if not lookahead.max_query_length < trie_depth <= MAX_DEPTH_LIMIT:
        raise ValueError(
            f"config.pbtxt parameter 'trie_depth': must be > max_query_length ({lookahead.max_query_length}) "
            f"and <= {MAX_DEPTH_LIMIT}, got {trie_depth}"
        )
    trie_capacity = read("trie_capacity", _int(minimum=1), 1_000_000)
    if trie_capacity < trie_depth:
        raise ValueError(
            f"config.pbtxt parameter 'trie_capacity': must be >= trie_depth ({trie_depth}) to hold one "
            f"n-gram, got {trie_capacity}"
        )
    return BackendConfig(
        model=read("model", str, DEFAULT_MODEL),
        dtype=read("dtype", _choice(tuple(DTYPES)), "float32"),
        device=read("device", _device, f"cuda:{instance_device_id}" if instance_kind == "GPU" else "cpu"),
        threads=read("threads", _int(minimum=0), 0),  # 0: torch's default
        linear_kernel=read("linear_kernel", _choice(LINEAR_KERNELS), "auto"),
        lookahead=lookahead,
        step_token_budget=read("step_token_budget", _int(minimum=1), 128),
        max_speculative_batch=read("max_speculative_batch", _int(minimum=0), MAX_SPECULATIVE_BATCH),
        prefix_cache_tokens=read("prefix_cache_tokens", _int(minimum=0), PREFIX_CACHE_TOKENS),
        trie_capacity=trie_capacity,
        trie_depth=trie_depth,
        trie_state_dir=state_dir,
        snapshot_interval_s=read("snapshot_interval_s", _float(minimum=0.0), 60.0),
        warmup_corpus=read("warmup_corpus", _path(repository), None),
        max_prompt_tokens=read("max_prompt_tokens", _int(minimum=1), 4096),
        max_output_tokens=read("max_output_tokens", _int(minimum=1), 1024),
        report_custom_metrics=read("REPORT_CUSTOM_METRICS", _bool, False),
        ignored_parameters=tuple(sorted(set(parameters) - read.names - _TRITON_RESERVED)),
    )


class _Reader:
    """Reads one parameter with a parser, falling back to a default when it is unset."""

    def __init__(self, parameters: Mapping[str, str]):
        self.parameters = parameters
        self.names: set[str] = set()

    def __call__(self, name: str, parser: Callable[[str], T], default: T) -> T:
        self.names.add(name)
        raw = self.parameters.get(name, "").strip()
        if not raw or (raw.startswith("${") and raw.endswith("}")):
            return default
        try:
            return parser(raw)
        except ValueError as error:
            raise ValueError(f"config.pbtxt parameter {name!r}: {error}") from None


def _field_in(error: ValueError, names: Mapping[str, Any]) -> str:
    """The field a LookaheadConfig validation message starts with."""
    return next((name for name in names if str(error).startswith(name)), "lookahead")


def _bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def _int(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _float(minimum: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
        if not value >= minimum:  # also rejects nan
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {raw!r}")
        return raw

    return parse


def _device(raw: str) -> str:
    kind, _, index = raw.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise ValueError(f"expected cpu, cuda or cuda:<index>, got {raw!r}")
    return raw


def _path(base: Path) -> Callable[[str], Path]:
    def parse(raw: str) -> Path:
        return (base / Path(raw).expanduser()).resolve()

    return parse
