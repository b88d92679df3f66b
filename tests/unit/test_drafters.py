"""The Drafter protocol: a drafter is chosen per model or per request, and the decoder drives it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import lookahead.config
from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.algorithm.draft import Draft
from lookahead.algorithm.drafters import DRAFTERS, DraftQuery, DraftRequest, TrieDrafter
from lookahead.algorithm.verify import Verdict
from lookahead.config import DRAFTER_NAMES
from tests.helpers import plain_greedy

PROMPT = [5, 6, 7, 8, 5, 6, 7]
MAX_TOKENS = 20


class Oracle:
    """Drafts the known output as one chain below the request's last token."""

    made: list[Oracle] = []
    output: list[int] = []

    def __init__(self, request: DraftRequest) -> None:
        self.prompt_len = len(request.prompt)
        self.queries: list[DraftQuery] = []
        self.verdicts: list[Verdict] = []
        self.extended: list[int] = []
        Oracle.made.append(self)

    def retrieve(self, query: DraftQuery) -> Draft:
        self.queries.append(query)
        done = len(query.context) - self.prompt_len
        chain = Oracle.output[done : done + min(query.depth, query.width - 1)]
        return Draft([query.context[-1], *chain], list(range(-1, len(chain))), [1.0] * (len(chain) + 1))

    def record_verdict(self, draft: Draft, verdict: Verdict) -> None:
        self.verdicts.append(verdict)

    def extend(self, tokens: Sequence[int]) -> None:
        self.extended.extend(tokens)


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> type[Oracle]:
    monkeypatch.setattr(lookahead.config, "DRAFTER_NAMES", (*DRAFTER_NAMES, "oracle"))
    monkeypatch.setitem(DRAFTERS, "oracle", Oracle)
    monkeypatch.setattr(Oracle, "made", [])
    return Oracle


def test_every_drafter_name_has_a_drafter() -> None:
    assert set(DRAFTERS) == set(DRAFTER_NAMES)
    assert DRAFTERS["trie"] is TrieDrafter
    with pytest.raises(ValueError, match="drafter must be one of trie, got 'suffix'"):
        LookaheadConfig(drafter="suffix")


@pytest.mark.parametrize("chosen_by", ["model", "request"])
def test_a_drafter_chosen_by_name_drafts_every_step_and_hears_every_verdict(
    chosen_by: str, oracle, tiny_model, byte_tokenizer
) -> None:
    model = tiny_model("llama")
    expected = plain_greedy(model, PROMPT, MAX_TOKENS)
    oracle.output = expected
    chosen = LookaheadConfig(drafter="oracle", decoding_length=6, branch_length=5, adaptive=False)
    instance = chosen if chosen_by == "model" else LookaheadConfig()
    decoder = LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=1000, max_depth=9), instance)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    output, stats = decoder.generate(PROMPT, params, chosen if chosen_by == "request" else None)
    assert output == expected
    (made,) = oracle.made
    assert made.extended == expected  # every committed token, in order
    assert len(made.verdicts) == len(made.queries) == stats.steps + 1  # the prompt's draft too
    assert stats.accepted_draft_tokens == sum(len(v.accepted_nodes) for v in made.verdicts)
    assert stats.accepted_draft_tokens == MAX_TOKENS - (stats.steps + 1)  # every drafted token taken
    assert all(query.depth <= 5 and query.width <= 6 for query in made.queries)
    # a request of the same decoder that does not choose it drafts from the tries
    decoder.generate(PROMPT, params, LookaheadConfig(drafter="trie"))
    assert len(oracle.made) == 1


def test_without_drafting_no_drafter_is_made(oracle, tiny_model, byte_tokenizer) -> None:
    decoder = LookaheadDecoder(tiny_model("llama"), byte_tokenizer, None, LookaheadConfig(drafter="oracle"))
    gen = decoder.start(PROMPT, SamplingParams(max_tokens=4), LookaheadConfig(use_lookahead=False))
    assert gen.drafter is None and oracle.made == []
    gen.close()
