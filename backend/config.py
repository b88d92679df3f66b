"""Instance settings from config.pbtxt `parameters`, parsed once in `initialize`.

Triton hands every parameter over as a string. We parse them into one frozen dataclass so a
typo or a bad value fails the model load with a message naming the parameter, instead of
surfacing later as a broken request. "" and an unfilled "${...}" template placeholder (the
TensorRT-LLM `fill_template.py` convention) both mean "use the default".
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from lookahead.algorithm.trie import MAX_DEPTH_LIMIT
from lookahead.config import (
    DRAFTER_NAMES,
    KV_CACHE_DTYPES,
    LINEAR_KERNELS,
    DecoderConfig,
    LookaheadConfig,
    TrieConfig,
)
from lookahead.contract import MODEL_ENV, STATE_DIR_ENV, SYNC_ENV
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import DTYPES
from lookahead.state.sync import check_url

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Keys read by others, accepted beside PARAMETERS: the Python backend's own, and the vLLM backend's
# health check switch, whose behaviour (a failed engine unreadies and unloads its model) is built in.
ACCEPTED_KEYS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS", "ENABLE_VLLM_HEALTH_CHECK"})

T = TypeVar("T")


@dataclass(frozen=True)
class BackendConfig:
    """Everything one model instance needs to load its model and serve requests. Each field's
    default is its config.pbtxt parameter's default (`PARAMETERS` maps the names).

    `lookahead` holds the instance defaults, which are also the maxima a request may ask for.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = ""  # "": cpu, or cuda:<device id> for a KIND_GPU instance
    threads: int = 0  # torch CPU threads; 0: torch's default
    linear_kernel: str = "auto"
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    trie: TrieConfig = field(default_factory=TrieConfig)
    trie_state_dir: Path | None = None  # None: $LOOKAHEAD_STATE_DIR (else <project>/.state) / <model name>
    snapshot_interval_s: float = 60.0
    warmup_corpus: Path | None = None
    trie_sync: str = ""  # "": the trie learns alone; else the Redis URL of the fleet's stream
    trie_sync_namespace: str = "lookahead"  # key prefix: fleets that must not share drafts use their own
    trie_sync_max_entries: int = 10000  # the stream's MAXLEN (approximate): what Redis retains
    max_prompt_tokens: int = 0  # 0: the model's context length, within kv_cache_bytes
    max_output_tokens: int = 0  # 0: only the model's context window bounds max_tokens
    max_running_requests: int = 16  # requests stepped together; the rest wait in the queue, in order
    max_queued_requests: int = 256  # requests waiting beyond this get UNAVAILABLE; 0: no bound
    queue_timeout_s: float = 0.0  # a request waiting longer gets UNAVAILABLE; 0: no bound
    report_custom_metrics: bool = True
    acceptance_outputs: bool = True  # return_perf_metrics may report a request's drafts (a side channel)
    stream_each_token: bool = False  # streaming: one response per token (requests may say otherwise)

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
    """Validate flat string parameters; raise ValueError naming the first bad parameter, or every
    unknown one (a typo must not leave a setting at its default unnoticed).

    Relative paths are resolved against the model repository (the folder holding the model's
    directory), so a repository can be moved or copied together with its state and corpora.
    """
    unknown = sorted(set(parameters) - set(PARAMETERS) - ACCEPTED_KEYS)
    if unknown:
        raise ValueError(f"unknown config.pbtxt parameters: {', '.join(map(_known_as, unknown))}")
    repository = model_dir.resolve().parent
    values: dict[tuple[str, ...], Any] = {}
    for env, name in ((MODEL_ENV, "model"), (SYNC_ENV, "trie_sync")):
        if os.environ.get(env, "").strip():
            parameters = {**parameters, name: os.environ[env]}
    for name, (where, parser) in PARAMETERS.items():
        raw = parameters.get(name, "").strip()
        if not raw or (raw.startswith("${") and raw.endswith("}")):
            continue  # "" and an unfilled template placeholder mean the default
        try:
            values[where] = parser(raw)
        except ValueError as error:
            raise ValueError(f"config.pbtxt parameter {name!r}: {error}") from None
    config = BackendConfig()
    sections = {}
    for section in ("lookahead", "decoder", "trie"):
        overrides = {where[1]: value for where, value in values.items() if where[0] == section}
        try:
            sections[section] = replace(getattr(config, section), **overrides)
        except ValueError as error:
            raise ValueError(f"config.pbtxt parameter {_parameter_of(section, error)!r}: {error}") from None
    trie = sections["trie"]
    query = sections["lookahead"].max_query_length
    if not query < trie.depth <= MAX_DEPTH_LIMIT:
        raise ValueError(
            f"config.pbtxt parameter 'trie_depth': must be > max_query_length ({query}) "
            f"and <= {MAX_DEPTH_LIMIT}, got {trie.depth}"
        )
    if trie.capacity < trie.depth:
        raise ValueError(
            f"config.pbtxt parameter 'trie_capacity': must be >= trie_depth ({trie.depth}) to hold one "
            f"n-gram, got {trie.capacity}"
        )
    top = {where[0]: value for where, value in values.items() if len(where) == 1}
    config = replace(config, **sections, **top)
    state_root = Path(os.environ.get(STATE_DIR_ENV) or PROJECT_ROOT / ".state")
    return replace(
        config,
        device=config.device or (f"cuda:{instance_device_id}" if instance_kind == "GPU" else "cpu"),
        trie_state_dir=(repository / config.trie_state_dir).resolve()
        if config.trie_state_dir
        else state_root / model_name,
        warmup_corpus=(repository / config.warmup_corpus).resolve() if config.warmup_corpus else None,
    )


def _known_as(name: str) -> str:
    """'name' and the known parameter it most likely misspells."""
    close = difflib.get_close_matches(name, PARAMETERS, n=1)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


def default_value(name: str) -> Any:
    """The default of the config.pbtxt parameter `name`, read off BackendConfig's fields."""
    value: Any = BackendConfig()
    for part in PARAMETERS[name][0]:
        value = getattr(value, part)
    return value


def _parameter_of(section: str, error: ValueError) -> str:
    """The parameter a section's validation message names (messages start with the field name)."""
    for name, (where, _) in PARAMETERS.items():
        if where[0] == section and str(error).startswith(where[1]):
            return name
    return section


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


def _namespace(raw: str) -> str:
    if not all(c.isalnum() or c in "-_.:" for c in raw):
        raise ValueError(f"expected letters, digits and -_.: only, got {raw!r}")
    return raw


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _stop_words(raw: str) -> tuple[int | str, ...]:
    """A JSON list of one-token strings and token ids, e.g. [",", ".", " ", 198]."""
    try:
        words = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"expected a JSON list of strings and token ids, got {raw!r}") from None
    if not isinstance(words, list) or not all(
        (isinstance(w, int) and not isinstance(w, bool)) or isinstance(w, str) for w in words
    ):
        raise ValueError(f"expected a JSON list of strings and token ids, got {raw!r}")
    return tuple(words)


# config.pbtxt parameter -> (where its value lives in BackendConfig, parser of its string)
PARAMETERS: dict[str, tuple[tuple[str, ...], Callable[..., Any]]] = {
    "model": (("model",), str),
    "dtype": (("dtype",), _choice(tuple(DTYPES))),
    "device": (("device",), _device),
    "threads": (("threads",), _int(minimum=0)),
    "linear_kernel": (("linear_kernel",), _choice(LINEAR_KERNELS)),
    "use_lookahead": (("lookahead", "use_lookahead"), _bool),
    "decoding_length": (("lookahead", "decoding_length"), _int(minimum=1)),
    "branch_length": (("lookahead", "branch_length"), _int(minimum=0)),
    "decoding_mode": (("lookahead", "decoding_mode"), str),
    "max_query_length": (("lookahead", "max_query_length"), _int(minimum=1)),
    "adaptive": (("lookahead", "adaptive"), _bool),
    "stop_words": (("lookahead", "stop_words"), _stop_words),
    "debug": (("lookahead", "debug"), _bool),
    "learn": (("lookahead", "learn"), _bool),
    "drafter": (("lookahead", "drafter"), _choice(DRAFTER_NAMES)),
    "step_token_budget": (("decoder", "step_token_budget"), _int(minimum=1)),
    "max_speculative_batch": (("decoder", "max_speculative_batch"), _int(minimum=0)),
    "prefix_cache_tokens": (("decoder", "prefix_cache_tokens"), _int(minimum=0)),
    "kv_cache_bytes": (("decoder", "kv_cache_bytes"), _int(minimum=0)),
    "kv_cache_dtype": (("decoder", "kv_cache_dtype"), _choice(KV_CACHE_DTYPES)),
    "grammar_compile_timeout_s": (("decoder", "grammar_compile_timeout_s"), _float(minimum=0.0)),
    "grammar_max_bytes": (("decoder", "grammar_max_bytes"), _int(minimum=1)),
    "grammar_max_choices": (("decoder", "grammar_max_choices"), _int(minimum=1)),
    "adaptive_threads": (("decoder", "adaptive_threads"), _bool),
    "trie_capacity": (("trie", "capacity"), _int(minimum=1)),
    "trie_depth": (("trie", "depth"), _int(minimum=2)),
    "trie_state_dir": (("trie_state_dir",), _path),
    "snapshot_interval_s": (("snapshot_interval_s",), _float(minimum=0.0)),
    "warmup_corpus": (("warmup_corpus",), _path),
    "trie_sync": (("trie_sync",), check_url),
    "trie_sync_namespace": (("trie_sync_namespace",), _namespace),
    "trie_sync_max_entries": (("trie_sync_max_entries",), _int(minimum=1)),
    "max_prompt_tokens": (("max_prompt_tokens",), _int(minimum=0)),
    "max_output_tokens": (("max_output_tokens",), _int(minimum=0)),
    "max_running_requests": (("max_running_requests",), _int(minimum=1)),
    "max_queued_requests": (("max_queued_requests",), _int(minimum=0)),
    "queue_timeout_s": (("queue_timeout_s",), _float(minimum=0.0)),
    "REPORT_CUSTOM_METRICS": (("report_custom_metrics",), _bool),
    "acceptance_outputs": (("acceptance_outputs",), _bool),
    "stream_each_token": (("stream_each_token",), _bool),
}
