"""The fast CPU path's top candidates: torch's top-k and log-sum-exp, in one pass per row."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lookahead.cpu.extension import load_extension
from lookahead.runtime import recycling
from tests.helpers import CPU_VARIANTS


@pytest.fixture(params=CPU_VARIANTS)
def extension(request: pytest.FixtureRequest) -> Any:
    return load_extension(request.param)


@pytest.mark.parametrize("rows, vocab, k", [(1, 49152, 8), (7, 1000, 4), (3, 37, 37), (2, 16, 1)])
def test_the_kernel_gives_torchs_top_k_and_log_sum_exp(rows: int, vocab: int, k: int, extension) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    values, ids, lse = extension.top_candidates(logits, k)
    expected_values, expected_ids = logits.topk(k, dim=-1)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)
    assert torch.allclose(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


def test_ties_go_to_the_lower_id_and_masked_logits_count_for_nothing(extension) -> None:
    row = torch.zeros(1, 40)
    row[0, 30] = row[0, 5] = row[0, 17] = 2.0
    _, ids, lse = extension.top_candidates(row, 3)
    assert ids.tolist() == [[5, 17, 30]]
    assert lse.item() == pytest.approx(torch.logsumexp(row, dim=-1).item(), rel=1e-6)
    masked = torch.full((1, 32), float("-inf"))
    masked[0, 3] = 1.5
    values, ids, lse = extension.top_candidates(masked, 2)
    assert ids[0, 0].item() == 3 and values[0, 0].item() == 1.5 and lse.item() == pytest.approx(1.5)
    with pytest.raises(RuntimeError, match="k must be within 1..32"):
        extension.top_candidates(masked, 33)


def test_recycling_takes_the_kernel_once_the_fast_path_loads(extension) -> None:
    logits = torch.randn(5, 300)
    values, ids, lse = recycling.top_candidates(logits, 4)
    assert torch.equal(ids, logits.topk(4, dim=-1).indices)
    assert torch.allclose(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)
    assert recycling._cpu_kernel is not None
    halves = recycling.top_candidates(logits.half(), 4)  # not fp32: torch's own
    assert torch.equal(halves[1], logits.half().topk(4, dim=-1).indices)
