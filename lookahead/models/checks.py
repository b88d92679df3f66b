"""Load-time checks: a model must score a draft tree exactly in one forward to be served losslessly."""

from __future__ import annotations

from typing import Any

import torch

from ..algorithm.draft import Draft
from ..runtime.runner import ModelRunner


class UnsupportedModelError(RuntimeError):
    """The model cannot verify a draft tree in one forward, so lookahead would not be lossless."""


# Largest logit difference accepted between a tree forward and plain decoding's one-token
# forwards, relative to the logits' magnitude. The CPU kernels give a row the same bits however
# many rows share its forward, so there the two agree exactly; elsewhere a multi-row forward
# rounds differently from a one-row one, by far less than a leak.
_TREE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# Int8-quantised activations (the integer kernel) outside the fused stack: attention in
# transformers' layers rounds a row's fp32 result differently by the rows beside it, and the next
# matrix's quantisation can turn that last bit into a whole quantisation step (1/127 of its
# block's largest value), as coarse as bfloat16.
_INT8_ACTIVATIONS_TOLERANCE = 5e-2


def check_tree_attention(model: Any) -> float:
    """Refuse a model that cannot score a draft tree exactly in one forward; return the largest
    logit difference between its tree and plain decoding (0.0 where they agree bit for bit).

    Runs the decoder's own forwards (runtime/runner.py, over its KV pool): after a short prompt,
    a root with two children in one forward, each child blind to its sibling, and compares every
    node's logits with plain decoding's, which feeds the same tokens one at a time. A model that
    ignores the mask (e.g. remote code) lets the second child attend to the first: its logits then
    match the chain root, first, second instead. Requiring the error to stay below half that leak
    keeps the check decisive in bfloat16 as well.
    """
    vocab = model.get_input_embeddings().num_embeddings
    dtype = next(model.parameters()).dtype
    prefix = [t % vocab for t in (11, 12, 13)]
    root, first, second = (t % vocab for t in (14, 15, 16))
    runner = ModelRunner(model, prefix_cache_tokens=0, kv_cache_bytes=0)
    try:
        with torch.inference_mode():
            tree = _pool_logits(runner, prefix, [Draft([root, first, second], [-1, 0, 0])])[0]
            leaky = _pool_logits(runner, prefix, [Draft([root, first, second], [-1, 0, 1])])[0]
            plain = _pool_logits(runner, prefix, [Draft.root_only(t) for t in (root, first)])
            second_plain = _pool_logits(runner, prefix, [Draft.root_only(t) for t in (root, second)])
    except Exception as err:  # whatever breaks, the tree forward is unusable for this model
        raise UnsupportedModelError(
            f"{type(model).__name__} failed a tree forward with a 4-D attention mask: {err}"
        ) from err
    expected = torch.cat([plain[0], plain[1], second_plain[1]]).float()
    error = (tree.float() - expected).abs().max().item()
    leak = (leaky[-1].float() - expected[-1]).abs().max().item()
    fused = getattr(getattr(model, "model", None), "stack", None)
    relative = (
        _INT8_ACTIVATIONS_TOLERANCE
        if _quantises_activations(model) and type(fused).__name__ != "FusedStack"
        else _TREE_TOLERANCE.get(dtype, 1e-4)
    )
    tolerance = relative * max(1.0, expected.abs().max().item())
    if not (error <= tolerance and error <= leak / 2):
        raise UnsupportedModelError(
            f"{type(model).__name__} does not honour a 4-D attention mask with position_ids: tree "
            f"logits differ from sequential ones by {error:.3g} (tolerance {tolerance:.3g}, sibling "
            f"leak {leak:.3g}), so lookahead verification would not be lossless; serve it with "
            "use_lookahead disabled"
        )
    return error


def _quantises_activations(model: Any) -> bool:
    """Whether some layer of `model` multiplies int8-quantised activations (lookahead.cpu's integer
    kernel marks its layers so)."""
    return any(getattr(module, "activations", None) == "int8" for module in model.modules())


def _pool_logits(runner: ModelRunner, prompt: list[int], drafts: list[Draft]) -> list[torch.Tensor]:
    """The logits of each draft, fed one forward each after `prompt` (and the drafts before it, as
    plain decoding commits them) in a fresh slot of the runner's pool."""
    with runner.scratch_slot() as slot:
        runner.forward_drafts([Draft(prompt, [-1, *range(len(prompt) - 1)])], [0], [slot])
        length, logits = len(prompt), []
        for draft in drafts:
            logits.append(runner.forward_drafts([draft], [length], [slot])[0])
            length += 1
        return logits
