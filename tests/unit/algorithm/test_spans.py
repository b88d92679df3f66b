"""SpanIndex: the longest earlier repeat of the latest tokens, and the copy drafts built from it."""

from __future__ import annotations

import random

import pytest

from lookahead.algorithm.retrieval import retrieve_draft
from lookahead.algorithm.spans import KEY, RESUME_WINDOW, Copy, SpanIndex
from lookahead.algorithm.trie import NGramTrie


def test_the_longest_repeat_wins_over_a_more_recent_shorter_one():
    long_source = [1, 2, 3, 4, 5, 6, 70, 71, 72]
    short_source = [9, 3, 4, 5, 6, 80, 81]
    index = SpanIndex([*long_source, *short_source, 1, 2, 3, 4, 5, 6])
    copy = index.continuation(5)
    assert copy == Copy([70, 71, 72, 9, 3], matched=6)


def test_equal_repeats_continue_the_most_recent_one():
    index = SpanIndex([1, 2, 3, 4, 10, 11, 1, 2, 3, 4, 20, 21, 0, 1, 2, 3, 4])
    assert index.continuation(2) == Copy([20, 21], matched=4)


def test_no_repeat_no_copy():
    assert SpanIndex([1, 2, 3, 4, 5, 6]).continuation(4) is None
    assert SpanIndex([1, 2, 3]).continuation(4) is None  # shorter than a key
    assert SpanIndex([1, 2, 3, 4, 1, 2, 3, 4]).continuation(0) is None


def test_extend_sees_new_tokens_and_a_self_overlapping_repeat():
    index = SpanIndex([5, 6, 7, 8])
    assert index.continuation(3) is None
    index.extend([5, 6, 7, 8])
    assert index.continuation(3) == Copy([5, 6, 7], matched=4)  # a loop continues itself
    index.extend([5])
    assert index.continuation(8).tokens == [6, 7, 8, 5]  # only what exists so far


def copying_then_broken(source: list[int]) -> SpanIndex:
    """An index over `source` whose output copied source[0:6] and then wrote 99 instead of source[6]."""
    index = SpanIndex([*source, *source[:4]])
    assert index.continuation(5) == Copy(source[4:9], matched=4)
    index.extend([*source[4:6], 99])
    return index


SOURCE = list(range(10, 60))


def test_a_copy_resumes_after_an_insertion():
    index = copying_then_broken(SOURCE)
    assert index.continuation(3) is None  # 99 is not in the source: nothing to resume from yet
    index.extend([SOURCE[6]])  # back to copying where it broke off
    assert index.continuation(3) == Copy(SOURCE[7:10], matched=1)


def test_a_copy_resumes_after_a_replacement():
    index = copying_then_broken(SOURCE)
    index.extend([98, SOURCE[8]])  # 99 98 replaced source[6:8]
    assert index.continuation(3) == Copy(SOURCE[9:12], matched=1)


def test_a_copy_resumes_only_within_the_window_after_its_break():
    index = copying_then_broken(SOURCE)
    index.extend([SOURCE[6 + RESUME_WINDOW]])
    assert index.continuation(3) is None
    index.extend([SOURCE[5]])  # before the break: not a resumption
    assert index.continuation(3) is None


def test_a_wrong_resumption_keeps_the_break():
    index = copying_then_broken(SOURCE)
    index.extend([SOURCE[20]])
    assert index.continuation(2) == Copy(SOURCE[21:23], matched=1)
    index.extend([97, SOURCE[6]])  # the guess was wrong; the model goes back to the break
    assert index.continuation(2) == Copy(SOURCE[7:9], matched=1)


def test_once_key_tokens_agree_again_the_longest_repeat_takes_over():
    index = copying_then_broken(SOURCE)
    index.extend(SOURCE[6:10])
    assert index.continuation(3) == Copy(SOURCE[10:13], matched=KEY)


def test_probabilities_follow_the_rule_of_succession():
    copy = Copy([1, 2, 3], matched=9)
    assert copy.conditional(0) == pytest.approx(10 / 11)
    reach = copy.conditional(0) * copy.conditional(1) * copy.conditional(2)
    assert reach == pytest.approx((9 + 1) / (9 + 3 + 1))


def test_matches_agree_with_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3) for _ in range(rng.randrange(KEY, 60))]
        copy = SpanIndex(ids).continuation(6)
        best = max(
            (
                (next(k for k in range(end + 1) if k == end or ids[end - 1 - k] != ids[-1 - k]), end)
                for end in range(KEY, len(ids))
                if ids[end - KEY : end] == ids[-KEY:]
            ),
            default=None,
        )
        if best is None:
            assert copy is None
        else:
            assert copy == Copy(ids[best[1] : best[1] + 6], best[0])


def test_a_copy_draft_runs_past_the_trie_depth():
    text = list(range(100, 140))
    local = NGramTrie(capacity=10_000, max_depth=8)
    local.insert([*text, 1, *text[:10]])
    context = [*text, 1, *text[:10]]
    copy = SpanIndex(context).continuation(24)
    without = retrieve_draft(context, local, None, decoding_length=64, branch_length=24, mode="one")
    with_copy = retrieve_draft(
        context, local, None, decoding_length=64, branch_length=24, mode="one", copy=copy
    )
    assert len(without) - 1 == 8 - 4  # the trie holds 8-grams: a 4-token query leaves 4
    assert with_copy.tokens[1:] == text[10:34] and max(with_copy.depths()) == 24
    assert with_copy.probs[1] > without.probs[1]


def test_a_copy_backs_off_to_the_tries_for_other_tokens():
    local = NGramTrie(capacity=10_000, max_depth=6)
    local.insert([1, 2, 3, 4, 50, 1, 2, 3, 4, 60])
    copy = Copy([70, 71], matched=4)  # disagrees with both trie continuations
    draft = retrieve_draft([1, 2, 3, 4], local, None, decoding_length=8, branch_length=2, copy=copy)
    first = {draft.tokens[i]: draft.probs[i] for i in range(1, len(draft)) if draft.parents[i] == 0}
    assert set(first) == {70, 50, 60}
    assert first[70] == pytest.approx(copy.conditional(0))
    assert sum(first.values()) <= 1.0 + 1e-9
    assert draft.tokens[1:3] == [70, 71]  # best branch first


def test_an_edit_made_once_is_drafted_at_the_next_occurrence():
    """A rename: the output copies the first line with 50 written as 60; once the copy agrees
    again, the next line's 50 after the same token is drafted as 60."""
    first = [10, 11, 12, 13, 50, 14, 15, 16, 17]
    second = [20, 21, 22, 13, 50, 24, 25]
    index = SpanIndex([*first, *second, 99])
    index.extend([10, 11, 12, 13])
    assert index.continuation(2).tokens == [50, 14]
    index.extend([60, 14, 15, 16, 17])
    copy = index.continuation(7)
    assert copy.tokens == [20, 21, 22, 13, 60, 24, 25]
    assert copy.edits == {4: 1}
    assert copy.conditional(4) == 2 / 3  # one sighting: (1 + 1) / (1 + 2)
    assert copy.conditional(5) == (4 + 5 + 1) / (4 + 5 + 2)  # the matched context's rule again
    index.extend([20, 21, 22, 13, 50])  # the model kept the old name here: the copy follows the source
    assert index.continuation(2).tokens == [24, 25]
