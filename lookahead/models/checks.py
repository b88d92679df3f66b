"""Load-time checks: a model must score a draft tree exactly in one forward to be served losslessly."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from ..runtime.output_layer import plain_logits
from ..runtime.step_inputs import additive_mask


class UnsupportedModelError(RuntimeError):
    """The model cannot verify a draft tree in one forward, so lookahead would not be lossless."""


# Largest logit difference accepted between a tree forward and plain forwards, relative to the
# logits' magnitude: cached and uncached forwards round differently, by far less than a leak.
_TREE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# On int8-quantised activations (the integer kernel) a rounding that differs between them moves a
# value by a quantisation step: as coarse as bfloat16. The decoder's own forwards on that path give
# every row the same bits however it is batched; this check only has to see the mask honoured.
_INT8_ACTIVATIONS_TOLERANCE = 5e-2
# Which tree nodes see which: a root with two children, each child blind to its sibling.
_TREE_VISIBILITY = ((True, False, False), (True, True, False), (True, False, True))


def check_tree_attention(model: Any) -> None:
    """Refuse a model that cannot score a draft tree exactly in one forward.

    Feeds, after a short cached prefix, a root with two children using a 4-D additive mask and
    explicit position ids, and compares every node's logits with a plain forward of that node's
    path. A model that ignores the mask (e.g. remote code) lets the second child attend to the
    first: its logits then match the "leaky" sequence root, first, second instead. Requiring the
    error to stay below half that leak keeps the check decisive in bfloat16 as well.
    """
    parameter = next(model.parameters())
    vocab, device, dtype = model.get_input_embeddings().num_embeddings, parameter.device, parameter.dtype
    prefix = [t % vocab for t in (11, 12, 13)]
    root, first, second = (t % vocab for t in (14, 15, 16))
    try:
        with torch.inference_mode():
            tree = _tree_logits(model, prefix, [root, first, second], device, dtype)
            leaky = plain_logits(model, prefix + [root, first, second], device)
            second_path = plain_logits(model, prefix + [root, second], device)
    except Exception as err:  # whatever breaks, the tree forward is unusable for this model
        raise UnsupportedModelError(
            f"{type(model).__name__} failed a tree forward with a 4-D attention mask: {err}"
        ) from err
    expected = torch.stack([leaky[-3], leaky[-2], second_path[-1]]).float()
    error = (tree.float() - expected).abs().max().item()
    leak = (leaky[-1].float() - expected[-1]).abs().max().item()
    relative = (
        _INT8_ACTIVATIONS_TOLERANCE if _quantises_activations(model) else _TREE_TOLERANCE.get(dtype, 1e-4)
    )
    tolerance = relative * max(1.0, expected.abs().max().item())
    if not (error <= tolerance and error <= leak / 2):
        raise UnsupportedModelError(
            f"{type(model).__name__} does not honour a 4-D attention mask with position_ids: tree "
            f"logits differ from sequential ones by {error:.3g} (tolerance {tolerance:.3g}, sibling "
            f"leak {leak:.3g}), so lookahead verification would not be lossless; serve it with "
            "use_lookahead disabled"
        )


def _quantises_activations(model: Any) -> bool:
    """Whether some layer of `model` multiplies int8-quantised activations (lookahead.cpu's integer
    kernel marks its layers so)."""
    return any(getattr(module, "activations", None) == "int8" for module in model.modules())


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
