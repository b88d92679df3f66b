"""retrieve_draft: reference test vectors, the reference's defects, draft invariants, adversarial input.

Every test runs twice: with retrieval's Python search and with the fast CPU path's C++ search."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from lookahead.algorithm import retrieval
from lookahead.algorithm.draft import Draft
from lookahead.algorithm.retrieval import retrieve_draft
from lookahead.algorithm.spans import Copy
from lookahead.algorithm.trie import NO_NODE, NGramTrie
from lookahead.config import DECODING_MODES
from lookahead.cpu.extension import chosen_variant, load_extension


@pytest.fixture(autouse=True, params=["python search", "extension search"])
def search(request: pytest.FixtureRequest) -> Iterator[None]:
    """The search the test's drafts come from; the one in use before is restored afterwards."""
    before = retrieval._native_search
    native = request.param == "extension search"
    retrieval.use_native_search(load_extension(chosen_variant()).best_first_draft if native else None)
    yield
    retrieval.use_native_search(before)


def trie_of(*sequences: list[int], max_depth: int = 8, capacity: int = 10_000) -> NGramTrie:
    trie = NGramTrie(capacity=capacity, max_depth=max_depth)
    for sequence in sequences:
        trie.insert(sequence)
    return trie


def branches(draft: Draft) -> set[tuple[int, ...]]:
    """Token paths from below the root to every leaf."""
    kids = draft.children()
    found = set()
    for leaf in (i for i in range(1, len(draft)) if not kids[i]):
        path, node = [], leaf
        while node:
            path.append(draft.tokens[node])
            node = draft.parents[node]
        found.add(tuple(reversed(path)))
    return found


def assert_valid(draft: Draft, context: list[int], decoding_length: int, branch_length: int) -> None:
    """The contract every caller relies on (Draft itself checks that parents come first)."""
    assert draft.tokens[0] == context[-1] and draft.probs[0] == 1.0
    assert len(draft) <= max(decoding_length, 1)
    assert max(draft.depths()) <= branch_length
    for i in range(1, len(draft)):
        assert 0.0 < draft.probs[i] <= draft.probs[draft.parents[i]]
    for kids in draft.children():  # best child first
        assert [draft.probs[k] for k in kids] == sorted((draft.probs[k] for k in kids), reverse=True)


def test_reference_vector_two_branches_under_one_root():
    """ALGORITHM.md §4.3: [1,2,3] and [1,2,4], query [1] -> root 1, then 2, then 3 and 4 as siblings."""
    draft = retrieve_draft([1], trie_of([1, 2, 3], [1, 2, 4]), None, decoding_length=16, branch_length=3)
    assert draft.tokens[:2] == [1, 2] and sorted(draft.tokens[2:]) == [3, 4]
    assert draft.parents == [-1, 0, 1, 1]
    mask = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    assert draft.ancestor_mask().astype(int).tolist() == mask


def test_reference_vector_prompt_with_a_repeated_pair():
    """§4.3: prompt [5,6,7,8,9,5,6,10,11], query [5,6] -> root 6 with branches 7->8->9 and 10->11."""
    local = trie_of([5, 6, 7, 8, 9, 5, 6, 10, 11], max_depth=5)  # query 2 + branch 3
    draft = retrieve_draft([5, 6], local, None, decoding_length=16, branch_length=3, max_query_length=2)
    assert draft.tokens[0] == 6 and len(draft) == 6
    assert branches(draft) == {(7, 8, 9), (10, 11)}
    chain = retrieve_draft(
        [5, 6], local, None, decoding_length=16, branch_length=3, mode="one", max_query_length=2
    )
    assert tuple(chain.tokens[1:]) in branches(draft) and chain.parents == list(range(-1, len(chain) - 1))


def test_defect_1_prompt_branch_survives_when_output_branches_overflow_the_budget():
    """§15.1: budget 3, root 2, prompt branch 3->4, output branches 5->6 and 5->7: the reference
    returned only [2, 5]; the request's own evidence must come first."""
    local = trie_of([2, 3, 4])
    shared = trie_of([2, 5, 6], [2, 5, 7])
    draft = retrieve_draft([2], local, shared, decoding_length=3, branch_length=3)
    assert draft.tokens[:2] == [2, 3] and len(draft) == 3
    full = retrieve_draft([2], local, shared, decoding_length=16, branch_length=3)
    assert branches(full) == {(3, 4), (5, 6), (5, 7)}
    assert full.tokens[1] == 3  # the prompt branch is the best one, laid out first


def test_defect_3_a_longer_match_is_not_replaced_by_a_worse_shorter_one():
    """The longer context predicts 8, 9 after 3; the bare token 3 is followed by many other things."""
    local = trie_of([1, 2, 3, 8, 9], [4, 3, 5], [6, 3, 7], [0, 3, 10])
    draft = retrieve_draft([1, 2, 3], local, None, decoding_length=8, branch_length=4)
    assert branches(draft) == {(8, 9)}
    assert draft.probs[1] > 0.7  # 3 tokens of context: strong evidence


def test_falls_back_to_a_shorter_context_when_the_longer_one_has_no_continuation():
    """The local trie holds the context itself; its only occurrence has no continuation yet."""
    local = trie_of([7, 3, 4, 5, 6, 9, 3])
    draft = retrieve_draft([6, 9, 3], local, None, decoding_length=8, branch_length=4)
    assert draft.tokens == [3, 4, 5, 6, 9]


def test_longer_matches_give_higher_confidence():
    local = trie_of([1, 2, 3, 4, 5])
    one_token = retrieve_draft([3], local, None, decoding_length=8, branch_length=2)
    three_tokens = retrieve_draft([1, 2, 3], local, None, decoding_length=8, branch_length=2)
    assert one_token.tokens == three_tokens.tokens == [3, 4, 5]
    assert one_token.probs[1] == pytest.approx(0.5)  # one prior occurrence, 1-token context
    assert three_tokens.probs[1] == pytest.approx(0.75)
    assert three_tokens.probs[2] > one_token.probs[2]


def test_occurrences_without_continuation_do_not_dilute_the_estimate():
    """The decoder has already fed the context itself to the tries; it says nothing about what follows."""
    prompt_only = trie_of([1, 2, 3, 4])
    local = NGramTrie(capacity=1_000, max_depth=8)
    local.writer().feed([1, 2, 3, 4, 9, 1, 2, 3])  # prompt + output so far, ending with the context
    for trie in (prompt_only, local):
        draft = retrieve_draft([9, 1, 2, 3], trie, None, decoding_length=8, branch_length=1)
        assert draft.tokens == [3, 4] and draft.probs[1] == pytest.approx(0.75)


def test_shared_evidence_fills_what_local_evidence_leaves_open():
    local = trie_of([1, 2, 3], [1, 2, 4])
    shared = trie_of(*[[1, 2, 5]] * 50)
    draft = retrieve_draft([1, 2], local, shared, decoding_length=8, branch_length=1)
    probs = dict(zip(draft.tokens[1:], draft.probs[1:], strict=True))
    assert set(probs) == {3, 4, 5}
    assert probs[3] == probs[4] > probs[5] > 0.0  # 2 local occurrences outweigh 50 global ones
    assert sum(probs.values()) < 1.0


def test_modes_share_the_hier_selection_and_budget():
    local = trie_of([1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8])
    kwargs = dict(decoding_length=16, branch_length=3)
    hier = retrieve_draft([1], local, None, **kwargs)
    par = retrieve_draft([1], local, None, mode="par", **kwargs)
    one = retrieve_draft([1], local, None, mode="one", **kwargs)
    assert branches(hier) == branches(par) == {(2, 3, 4), (2, 5, 6), (7, 8)}
    assert len(hier) == 8 and len(par) == 9  # par repeats the shared prefix 2
    assert all(kids == [] or len(kids) == 1 for kids in par.children()[1:])  # chains under the root
    assert one.parents == [-1, 0, 1, 2] and tuple(one.tokens[1:]) in branches(hier)
    small_par = retrieve_draft([1], local, None, mode="par", decoding_length=5, branch_length=3)
    assert len(small_par) == 5


@pytest.mark.parametrize("mode", DECODING_MODES)
def test_nothing_is_drafted_past_a_stop_token(mode):
    """The request ends at its EOS, so a branch through one stops there, copies included."""
    local = trie_of([1, 2, 0, 3, 4])
    copy = Copy([2, 0, 3, 4], matched=8)
    kwargs = dict(decoding_length=16, branch_length=4, mode=mode)
    assert branches(retrieve_draft([1], local, None, copy=copy, **kwargs)) == {(2, 0, 3, 4)}
    stopped = retrieve_draft([1], local, None, copy=copy, stop_tokens=frozenset({0}), **kwargs)
    assert branches(stopped) == {(2, 0)}


def test_nothing_to_draft_gives_the_bare_root():
    trie = trie_of([1, 2, 3])
    for draft in (
        retrieve_draft([9], trie, trie, decoding_length=8, branch_length=4),
        retrieve_draft([3], trie, None, decoding_length=8, branch_length=4),  # matched, no continuation
        retrieve_draft([1], None, None, decoding_length=8, branch_length=4),
        retrieve_draft([1], trie, None, decoding_length=1, branch_length=4),
        retrieve_draft([1], trie, None, decoding_length=8, branch_length=0),
    ):
        assert draft == Draft.root_only(draft.tokens[0])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="context"):
        retrieve_draft([], None, None, decoding_length=8, branch_length=4)
    with pytest.raises(ValueError, match="mode must be one of hier, par, one, got 'tree'"):
        retrieve_draft([1], None, None, decoding_length=8, branch_length=4, mode="tree")


@pytest.mark.parametrize("mode", DECODING_MODES)
def test_random_drafts_keep_every_invariant(mode):
    rng = random.Random(DECODING_MODES.index(mode))
    for _ in range(60):
        vocab = rng.choice([3, 8, 50])
        local = trie_of(*[[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(2)])
        shared = trie_of(*[[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(5)])
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        decoding_length, branch_length = rng.randrange(1, 40), rng.randrange(0, 7)
        draft = retrieve_draft(
            context, local, shared, decoding_length=decoding_length, branch_length=branch_length, mode=mode
        )
        assert_valid(draft, context, decoding_length, branch_length)
        for path in branches(draft):  # every branch is a real continuation in one of the tries
            assert (
                local.match([context[-1], *path]) != NO_NODE or shared.match([context[-1], *path]) != NO_NODE
            )
        single = dict(branch_length=branch_length, mode=mode, max_query_length=1)  # one candidate query
        draft = retrieve_draft(context, local, shared, decoding_length=decoding_length, **single)
        if mode == "hier" and len(draft) < decoding_length:  # budget left: nothing reachable was skipped
            assert draft == retrieve_draft(
                context, local, shared, decoding_length=decoding_length + 50, **single
            )


def test_adversarial_streams_stay_bounded_and_keep_drafts_valid():
    capacity = 5_000
    shared = NGramTrie(capacity=capacity, max_depth=16)
    rng = random.Random(0)
    streams = {
        "huge vocabulary spread": [rng.randrange(1 << 31) for _ in range(3_000)],
        "long prompt": [rng.randrange(50) for _ in range(4_000)],
        "one token 100k times": [7] * 100_000,
    }
    for name, stream in streams.items():
        writer = shared.writer()
        for token in stream:
            writer.feed([token])
            assert shared.node_count <= capacity, name
        local = NGramTrie(capacity=capacity, max_depth=16)
        local.insert(stream[-20_000:])  # a long prompt into a bounded per-request trie
        assert local.node_count <= capacity, name
        for end in (1, len(stream) // 2, len(stream)):
            context = stream[max(0, end - 4) : end]
            for mode in DECODING_MODES:
                draft = retrieve_draft(
                    context, local, shared, decoding_length=64, branch_length=12, mode=mode
                )
                assert_valid(draft, context, 64, 12)
    repeated = retrieve_draft([7, 7, 7, 7], None, shared, decoding_length=64, branch_length=12)
    assert repeated.tokens == [7] * 13  # one chain: the only continuation of 7 is 7


@pytest.mark.parametrize("mode", DECODING_MODES)
def test_min_prob_drops_exactly_the_nodes_less_probable_than_it(mode):
    rng = random.Random(7 + DECODING_MODES.index(mode))
    for _ in range(60):
        vocab = rng.choice([3, 8, 50])
        local = trie_of(*[[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(3)])
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        kwargs = dict(decoding_length=rng.randrange(2, 40), branch_length=rng.randrange(1, 7), mode=mode)
        full = retrieve_draft(context, local, None, max_query_length=1, **kwargs)
        least = rng.choice([0.1, 0.3, 0.6])
        pruned = retrieve_draft(context, local, None, max_query_length=1, min_prob=least, **kwargs)
        assert all(prob >= least for prob in pruned.probs)
        if mode != "par":  # every node of the full draft that is probable enough is still drafted
            kept = {(path, prob) for path, prob in _paths(full) if prob >= least}
            assert kept == set(_paths(pruned))


def _paths(draft: Draft) -> list[tuple[tuple[int, ...], float]]:
    """(token path from below the root, probability) of every node."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(draft)):
        paths.append((*paths[draft.parents[i]], draft.tokens[i]))
    return list(zip(paths[1:], draft.probs[1:]))
