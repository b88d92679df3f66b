"""A GGUF file as a transformers model: its config, tokenizer, chat template and weights, all from the file.

`open_gguf(path)` checks the file (gguf_header.py) and its metadata (gguf_checks.py); whatever
makes it unservable (missing, a directory, not GGUF, truncated, an architecture or tensor type
this loader does not read, sizes or token ids transformers cannot build a model of, a tokenizer
that cannot be built, a chat template that cannot render) is a `GGUFError` of one line naming
the file and what is wrong. `GGUFModelFile.build()` makes the
transformers model on the meta device (no memory) and fills it through gguf's tensor name map
and transformers' GGUF tensor processors. Where the weights can stay compact it fills only the
small tensors:

- a linear layer whose blocks have an integer form (gguf_blocks.py) stays empty, and `forms`
  hands the form to the fast CPU path's packing, one matrix at a time (its rows in the order
  the tensor processor puts them, e.g. Llama's q and k un-permuted);
- the input embedding keeps its blocks (quantized_embedding.py);
- `fill_empty()` dequantises whatever the execution path did not pack (the stock layers).

So the model never holds 4 bytes per quantised weight. Tensors are read with pread, not through
a memory map, so the process's resident memory is what the model keeps. The tokenizer and the
config are converted from the file once and kept in the model cache (<cache>/gguf-metadata/, by
the digest of the file's header, or by an embedded model's name).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
from gguf.quants import dequantize
from torch import nn

from .embedded import cache_dir
from .gguf_blocks import UNPACKERS, BlockForm, integer_form
from .gguf_checks import MetadataError, check_chat_template, check_merges, check_metadata
from .gguf_header import MAGIC, GGUFHeader, HeaderError, TensorInfo, read_header, read_strings
from .quantized_embedding import QuantizedEmbedding

# general.architecture values loaded here: transformers' GGUF loader reads each into a causal LM
# whose weights need nothing from its tensor processor but a row order or a small tensor's offset.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
_PLAIN_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}  # read without a block codec
_CONVERTED = "config.json"  # written last into a converted folder


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file and what is wrong, in one line."""


def is_gguf_path(name_or_path: str) -> bool:
    """Whether a model name is a GGUF file's path (by its suffix, whether or not it exists)."""
    return name_or_path.lower().endswith(".gguf")


def open_gguf(path: str | Path, cache_key: str | None = None) -> GGUFModelFile:
    """The checked file; GGUFError (FileNotFoundError for a missing file) naming it otherwise.
    cache_key: the name of its converted folder in the model cache (default: its header's digest)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise GGUFError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with open(path, "rb") as file:
        magic = file.read(len(MAGIC))
    if magic != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    try:
        header = read_header(path)
    except HeaderError as error:
        raise GGUFError(f"{path} is not a readable GGUF file: {error}") from None
    return GGUFModelFile(path, header, cache_key)


class GGUFModelFile:
    """One checked GGUF file: its architecture, tensors, config and tokenizer."""

    def __init__(self, path: Path, header: GGUFHeader, cache_key: str | None = None):
        self.path = path
        self.header = header
        self.tensors = header.tensors
        self.architecture = str(header.metadata.get("general.architecture", "(none)"))
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(
                f"{path}: architecture {self.architecture!r} is not one this server loads from GGUF "
                f"({', '.join(ARCHITECTURES)})"
            )
        readable = _PLAIN_TYPES | _dequantizable()
        for tensor in self.tensors.values():
            if tensor.qtype not in readable:
                raise GGUFError(
                    f"{path}: tensor {tensor.name} has type {tensor.qtype.name}, which this server "
                    "cannot read (gguf has no dequantisation for it)"
                )
        try:
            check_metadata(header.metadata, self.tensors, self.architecture)
        except MetadataError as error:
            raise GGUFError(f"{path}: {error}") from None
        with open(path, "rb") as file:
            self.digest = hashlib.blake2b(file.read(header.data_offset), digest_size=16).hexdigest()
        self.cache_key = cache_key or self.digest
        self.sources: dict[nn.Module, TensorInfo] = {}  # layers left empty -> the tensor to fill them
        # What the packing knows of each linear layer: its form, or None (fp32, loaded already)
        self.forms: dict[nn.Linear, Callable[[], BlockForm] | None] = {}
        self.processor: Any = None
        self._row_orders: dict[str, torch.Tensor | None | bool] = {}

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.model" in self.header.metadata

    def converted_folder(self) -> Path:
        """A Hugging Face folder holding the file's config, and its tokenizer and chat template when
        it has one: converted from the file once (tens of seconds for a large vocabulary) under an
        exclusive lock, then read in a second."""
        target = cache_dir() / "gguf-metadata" / self.cache_key
        if (target / _CONVERTED).is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_name(target.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / _CONVERTED).is_file():
                staging = Path(tempfile.mkdtemp(prefix=f".{self.cache_key}-", dir=target.parent))
                try:
                    os.chmod(staging, 0o755)  # mkdtemp's 0o700 would hide it from other users
                    if self.has_tokenizer:
                        self._check_merges()
                        tokenizer = self._from_file("AutoTokenizer", "tokenizer")
                        try:
                            check_chat_template(tokenizer)
                        except MetadataError as error:
                            raise GGUFError(f"{self.path}: {error}") from None
                        tokenizer.save_pretrained(staging)
                    self._from_file("AutoConfig", "config").save_pretrained(staging)
                    shutil.rmtree(target, ignore_errors=True)
                    os.rename(staging, target)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
        return target

    def _check_merges(self) -> None:
        tokens = self.header.metadata.get("tokenizer.ggml.tokens")
        merges = self.header.metadata.get("tokenizer.ggml.merges")
        if tokens is None or merges is None:
            return
        try:
            check_merges(read_strings(self.path, tokens), read_strings(self.path, merges))
        except (MetadataError, HeaderError) as error:
            raise GGUFError(f"{self.path}: {error}") from None

    def _from_file(self, auto_class: str, what: str) -> Any:
        import transformers

        try:
            return getattr(transformers, auto_class).from_pretrained(
                str(self.path.parent), gguf_file=self.path.name, local_files_only=True
            )
        except BaseException as error:  # transformers' and tokenizers' own (a Rust panic included)
            if not isinstance(error, Exception) and type(error).__name__ != "PanicException":
                raise  # KeyboardInterrupt, SystemExit
            raise GGUFError(
                f"{self.path}: its {what} cannot be built from its metadata "
                f"({type(error).__name__}: {_one_line(error)})"
            ) from None

    def build(self, dtype: torch.dtype, compact: bool) -> Any:
        """The transformers model, in eval mode. compact (fp32 on the CPU): linear layers with an
        integer form stay empty (see `forms`) and the input embedding keeps its blocks; else every
        weight is dequantised into `dtype`."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        config = AutoConfig.from_pretrained(self.converted_folder(), local_files_only=True)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        self.processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=config.to_dict())
        embedding = model.get_input_embeddings()
        targets = self._targets(model)
        for tensor in self.tensors.values():
            target = targets.get(tensor.name)
            if target is None:
                continue  # e.g. llama 3's rope_freqs: transformers computes them
            module_name, _, attribute = target.rpartition(".")
            module = model.get_submodule(module_name)
            self._check_shape(tensor, getattr(module, attribute), target)
            if compact and module is embedding and attribute == "weight":
                model.set_input_embeddings(self._quantized_embedding(tensor, module))
            elif compact and type(module) is nn.Linear and attribute == "weight":
                self._leave_empty(module, tensor)
            else:
                weight = nn.Parameter(self._dequantized(tensor, dtype), requires_grad=False)
                setattr(module, attribute, weight)
        head = model.get_output_embeddings()
        tied = self.tensors.get("token_embd.weight")
        if head is not None and head.weight.is_meta and "output.weight" not in self.tensors and tied:
            if compact:
                self._leave_empty(head, tied)
            else:
                head.weight = model.get_input_embeddings().weight
        empty = {name for name, module in model.named_modules() if module in self.sources}
        for name, parameter in model.named_parameters():
            if parameter.is_meta and name.rpartition(".")[0] not in empty:
                raise GGUFError(f"{self.path} has no tensor for the model's {name}")
        return model

    def fill_empty(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Dequantise every layer of `model` left empty that the execution path did not pack."""
        present = set(model.modules())
        for module, tensor in self.sources.items():
            if module in present and module.weight.is_meta:
                module.weight = nn.Parameter(self._dequantized(tensor, dtype), requires_grad=False)
        self.sources.clear()
        self.forms.clear()

    def _targets(self, model: nn.Module) -> dict[str, str]:
        """The model's parameter name for each tensor name of the file (gguf's name map)."""
        arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == self.architecture)
        names = get_tensor_name_map(arch, model.config.num_hidden_layers)
        targets = {}
        for parameter in model.state_dict(keep_vars=True):
            base, _, suffix = parameter.rpartition(".")
            found = names.get_name(base)
            if found is not None:
                targets[f"{found}.{suffix}"] = parameter
        return targets

    def _leave_empty(self, linear: nn.Linear, tensor: TensorInfo) -> None:
        """Leave the layer's weight empty for its integer form, or, for a type without one, load it
        in fp32 now (and spare the packing a search)."""
        if tensor.qtype in UNPACKERS and self._row_order(tensor) is not False:
            self.sources[linear] = tensor
            self.forms[linear] = lambda: self._form(tensor)
        else:
            linear.weight = nn.Parameter(self._dequantized(tensor, torch.float32), requires_grad=False)
            self.forms[linear] = None

    def _form(self, tensor: TensorInfo) -> BlockForm:
        form = integer_form(self._read(tensor), tensor.qtype)
        order = self._row_order(tensor)
        return form if order is None else form.permuted(order)

    def _row_order(self, tensor: TensorInfo) -> torch.Tensor | None | bool:
        """The rows of the file's matrix in the model's order (None: as stored), as the tensor
        processor reorders them; False when it does more than reorder rows."""
        if tensor.name not in self._row_orders:
            rows = tensor.shape[0]
            index = np.stack([np.arange(rows), np.arange(rows) + rows], axis=1).astype(np.float64)
            moved = np.asarray(self.processor.process(weights=index, name=tensor.name).weights)
            order = moved[:, 0].astype(np.int64) if moved.shape == index.shape else None
            if (
                order is None
                or not (np.sort(order) == np.arange(rows)).all()
                or not (moved[:, 1] == moved[:, 0] + rows).all()
            ):
                self._row_orders[tensor.name] = False
            elif (order == np.arange(rows)).all():
                self._row_orders[tensor.name] = None
            else:
                self._row_orders[tensor.name] = torch.from_numpy(order)
        return self._row_orders[tensor.name]

    def _quantized_embedding(self, tensor: TensorInfo, stock: nn.Module) -> QuantizedEmbedding:
        scale = getattr(stock, "embed_scale", None)
        return QuantizedEmbedding(self._read(tensor), tensor.qtype, tensor.shape[-1], scale)

    def _dequantized(self, tensor: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
        """The tensor as transformers loads it: dequantised by gguf, then through the processor."""
        weights = dequantize(self._read(tensor), tensor.qtype)
        weights = self.processor.process(weights=weights, name=tensor.name).weights
        return torch.from_numpy(np.ascontiguousarray(weights)).to(dtype)

    def _read(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes, a row of bytes per row, in memory of its own."""
        buffer = bytearray(tensor.n_bytes)
        view, done = memoryview(buffer), 0
        with open(self.path, "rb", buffering=0) as file:
            while done < len(buffer):
                count = os.preadv(file.fileno(), [view[done:]], tensor.offset + done)
                if count == 0:
                    raise GGUFError(f"{self.path} is truncated: tensor {tensor.name} could not be read")
                done += count
        return np.frombuffer(buffer, dtype=np.uint8).reshape(*tensor.shape[:-1], tensor.row_bytes)

    def _check_shape(self, tensor: TensorInfo, parameter: torch.Tensor, target: str) -> None:
        if tensor.shape != tuple(parameter.shape):
            raise GGUFError(
                f"{self.path}: tensor {tensor.name} has shape {list(tensor.shape)}, the model's {target} "
                f"{list(parameter.shape)} (its metadata does not match its tensors)"
            )


def _dequantizable() -> set[GGMLQuantizationType]:
    from gguf.quants import _type_traits  # the block types gguf dequantises

    return set(_type_traits)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__
