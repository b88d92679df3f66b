"""verify: the longest branch the model agrees with plus one bonus token, walked from the root."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from lookahead.algorithm.draft import Draft
from lookahead.algorithm.verify import verify
from lookahead.config import SamplingParams
from lookahead.runtime.sampling import TokenSelector

VOCAB = 10

# root 5 with two branches: 7 -> 8, and 9 with children 3 and 4
TREE = Draft(tokens=[5, 7, 8, 9, 3, 4], parents=[-1, 0, 1, 0, 3, 3])


def choosing(choices: dict[int, int]) -> torch.Tensor:
    """Logits whose row k makes choices[k] the model's token after node k (row 0 otherwise)."""
    logits = torch.zeros(len(TREE), VOCAB)
    for node, token in choices.items():
        logits[node, token] = 5.0
    return logits


def greedy() -> TokenSelector:
    return TokenSelector(SamplingParams(), prompt_ids=[], stop_ids=[], device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("choices", "accepted", "tokens"),
    [
        ({0: 9, 3: 4, 5: 2}, [3, 5], [9, 4, 2]),  # the second branch, then its second child
        ({0: 7, 1: 8, 2: 6, 3: 4}, [1, 2], [7, 8, 6]),  # the whole first branch, bonus below its leaf
        ({0: 9, 3: 6, 4: 1}, [3], [9, 6]),  # agrees on 9, then on neither child
        ({0: 1, 1: 8, 3: 3}, [], [1]),  # disagrees at the root: plain decoding's one token
    ],
)
def test_greedy_accepts_the_branch_of_the_models_argmax_plus_a_bonus_token(choices, accepted, tokens):
    verdict = verify(TREE, choosing(choices), greedy())
    assert verdict.accepted_nodes == accepted
    assert verdict.tokens == tokens
    assert verdict.rows == [0, *accepted]


class Scripted:
    """A selector that needs paths: the token after each path, and the paths it was asked about."""

    needs_path = True

    def __init__(self, after: dict[tuple[int, ...], int]):
        self.after = after
        self.asked: list[tuple[tuple[int, ...], int]] = []

    def select(self, path: Sequence[int], logits: torch.Tensor) -> int:
        self.asked.append((tuple(path), int(logits.argmax())))
        return self.after[tuple(path)]

    def greedy_choices(self, logits: torch.Tensor) -> Callable[[int], int]:
        raise AssertionError("a selector that needs paths is never batched")


def test_a_path_dependent_selector_is_asked_along_the_accepted_branch_only():
    logits = torch.eye(len(TREE), VOCAB)  # row k's argmax is k: tells which row each call got
    selector = Scripted({(): 9, (9,): 3, (9, 3): 0})
    verdict = verify(TREE, logits, selector)
    assert (verdict.accepted_nodes, verdict.tokens) == ([3, 4], [9, 3, 0])
    assert selector.asked == [((), 0), ((9,), 3), ((9, 3), 4)]


def sampler(seed: int) -> TokenSelector:
    params = SamplingParams(temperature=1.0, seed=seed)
    return TokenSelector(params, prompt_ids=[], stop_ids=[], device=torch.device("cpu"))


def test_sampling_where_each_row_allows_one_token_accepts_that_branch():
    logits = torch.full((len(TREE), VOCAB), -float("inf"))
    for node, token in {0: 7, 1: 8, 2: 2, 3: 3}.items():
        logits[node, token] = 0.0
    verdict = verify(TREE, logits, sampler(seed=1))
    assert (verdict.accepted_nodes, verdict.tokens) == ([1, 2], [7, 8, 2])


@pytest.mark.parametrize("seed", range(8))
def test_sampled_tokens_are_the_plain_seeded_draws_of_the_rows_walked(seed):
    """One draw per emitted token from the request's generator, as plain sampling draws them."""
    probs = torch.zeros(len(TREE), VOCAB)
    probs[:, [0, 1]] = 0.1
    probs[0, [7, 9]] = 0.4
    probs[3, [3, 4]] = 0.4
    probs[[1, 2, 4, 5], [8, 6, 5, 2]] = 0.8
    logits = probs.log()
    verdict = verify(TREE, logits, sampler(seed))
    generator = torch.Generator().manual_seed(seed)
    plain = [int(torch.multinomial(logits[row].softmax(-1), 1, generator=generator)) for row in verdict.rows]
    assert verdict.tokens == plain
    assert [TREE.tokens[node] for node in verdict.accepted_nodes] == verdict.tokens[:-1]
    for parent, child in zip(verdict.rows, verdict.accepted_nodes):
        assert TREE.parents[child] == parent
