"""The one entry point of the fast CPU path, called by model loading.

`apply_fast_path` swaps modules of a loaded model for faster ones and says what it did:
grouped-query SDPA that reads K/V heads in place (attention.py), fp32 linear layers packed for the
kernel variant this CPU runs best (packed_linear.py), and, where they give the same bits, lean
decoder layers run from C++ (lean_layers.py). On the "packed" kernel every swap keeps the model's
results bit for bit; on the "integer" kernel the linear layers multiply int8 activations with the
weights' integer forms and the layers on the decoder's KV pool run fused (csrc/fused_stack.h):
llama.cpp's arithmetic, whose results still do not depend on what else shares a forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..algorithm.cost_priors import cost_prior
from ..config import LINEAR_KERNELS
from .attention import use_grouped_sdpa
from .extension import (
    FastPathUnavailable,
    Variant,
    chosen_variant,
    load_extension,
    runnable_variants,
    why_no_variant,
)
from .lean_layers import use_lean_layers
from .packed_linear import KnownForms, pack_linear_layers, search_integer_forms

logger = logging.getLogger("lookahead")


@dataclass(frozen=True)
class FastPath:
    """What `apply_fast_path` did to a model."""

    linear_kernel: str  # "integer", "packed" or "stock"
    variant: str | None = None  # the kernel variant, when packed
    cost_prior: dict[int, float] | None = None  # the forward's measured cost curve on this path
    reason: str = ""  # why the stock layers are used, when they are
    lean_layers: bool = False

    def describe(self) -> str:
        if self.linear_kernel == "stock":
            return f"stock linear layers ({self.reason})" if self.reason else "stock linear layers"
        layers = "lean layers" if self.lean_layers else "transformers' layers"
        if self.linear_kernel == "integer":
            layers = "fused layers" if self.lean_layers else layers
            return f"integer {self.variant} kernel (int8 activations), {layers}"
        return f"packed {self.variant} kernel, {layers}"


def apply_fast_path(
    model: Any, linear_kernel: str = "auto", variant: Variant | None = None, known: KnownForms | None = None
) -> FastPath:
    """Put `model` on the linear kernel named `linear_kernel` ("auto": integer where the fast
    path can run, the fastest; "packed" is the fp32 arithmetic whose greedy output agrees with
    transformers'), on `variant` of the kernel
    (None: `chosen_variant()`). `known`: the integer forms the caller knows (see
    packed_linear.KnownForms); on the stock kernel the caller fills those layers itself.

    Raises ValueError for an unknown name and FastPathUnavailable when "integer" or "packed"
    cannot run here.
    """
    if linear_kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, not {linear_kernel!r}")
    use_grouped_sdpa(model)
    if linear_kernel == "stock":
        return FastPath("stock", reason="linear_kernel stock")
    try:
        _check_model(model)
        variant = variant or chosen_variant()
        extension = load_extension(variant)
    except FastPathUnavailable as error:
        if linear_kernel != "auto":
            raise
        logger.info("linear_kernel auto: stock (%s)", error)
        return FastPath("stock", reason=str(error))
    if linear_kernel == "auto":
        linear_kernel = "integer"
    activations = "int8" if linear_kernel == "integer" else "fp32"
    pack_linear_layers(model, extension, known, activations=activations)
    lean = use_lean_layers(model, extension, fused=linear_kernel == "integer")
    if not lean:
        logger.info("%s kernel: %s keeps transformers' decoder layers", linear_kernel, type(model).__name__)
    return FastPath(linear_kernel, variant.name, cost_prior(linear_kernel, variant.name), lean_layers=lean)


def _check_model(model: Any) -> None:
    parameter = next(p for p in model.parameters() if not p.is_meta)  # a known form's layer is empty
    if parameter.device.type != "cpu":
        raise FastPathUnavailable(f"the packed kernel runs on the CPU, not {parameter.device}")
    if parameter.dtype != torch.float32:
        raise FastPathUnavailable(
            f"the packed kernel is fp32 only, not {str(parameter.dtype).removeprefix('torch.')}"
        )


def prepare() -> list[str]:
    """Build every variant this CPU runs ahead of time (scripts/bootstrap.sh), so that no model
    load waits for a compile; one line per variant, or why the stock layers will be used."""
    variants = runnable_variants()
    if not variants:
        return [f"unavailable, the stock layers will be used ({why_no_variant()})"]
    lines = []
    for variant in variants:
        try:
            lines.append(f"{variant.name}: {load_extension(variant).__file__}")
        except FastPathUnavailable as error:
            lines.append(f"{variant.name}: unavailable ({error})")
    return lines


def prepare_integer_forms(model: Any, progress: Callable[[int, int], None] | None = None) -> bool:
    """Search the integer forms of a model's weights ahead of serving (its first load's longest
    part), so that every process loading it later reads them from the cache; progress(done,
    total) after each matrix. False, searching nothing, where the packed kernel would not run."""
    try:
        _check_model(model)
    except FastPathUnavailable:
        return False
    if not runnable_variants():
        return False
    search_integer_forms(model, progress)
    return True
