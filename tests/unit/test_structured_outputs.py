"""Structured outputs under tree speculation: lossless against plain constrained decoding, drafts
pruned by their own branch's grammar state, compile errors and bounds."""

from __future__ import annotations

import json
import re

import pytest
import torch

from bench.json_extraction import json_extraction_prompts, schema_errors
from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.algorithm.draft import FROM_GRAMMAR, Draft
from lookahead.algorithm.retrieval import retrieve_draft
from lookahead.config import DECODING_MODES, StructuredOutputs
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_tokenizer
from lookahead.structured import GrammarCompiler, GrammarMatcher

VOCAB = 49152  # SmolLM2's tokenizer, on tiny random models of the same vocabulary
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputs("json", json.dumps(SCHEMA), any_whitespace=False),
    "regex": StructuredOutputs("regex", r"[a-z]{2,6}( [a-z]{2,6}){2}\."),
    "choice": StructuredOutputs("choice", json.dumps(["alpha beta", "alpha gamma", "delta"])),
    "grammar": StructuredOutputs("grammar", 'start: "x=" NUM ("," NUM)* ";"\nNUM: /[0-9]{1,3}/'),
    "gbnf": StructuredOutputs("grammar", 'root ::= "(" [a-c]+ ")"'),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, [tokenizer.eos_token_id], VOCAB, timeout_s=30)


@pytest.fixture
def peaky(tiny_model):
    """A tiny model of SmolLM2's vocabulary with sharp distributions, so that drafts of its own
    constrained output are accepted."""
    model = tiny_model("llama", vocab_size=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    return model


def conforms(kind: str, text: str) -> bool:
    if kind == "json":
        return not schema_errors(json.loads(text), SCHEMA)
    if kind == "regex":
        return re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){2}\.", text) is not None
    if kind == "choice":
        return text in ("alpha beta", "alpha gamma", "delta")
    if kind == "grammar":
        return re.fullmatch(r"x=[0-9]{1,3}(,[0-9]{1,3})*;", text) is not None
    return re.fullmatch(r"\([a-c]+\)", text) is not None


def run(decoder: LookaheadDecoder, prompt: list[int], params: SamplingParams, lookahead=None):
    gen = decoder.start(prompt, params, lookahead)
    while not gen.finished:
        gen.step()
    return gen


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 3}], ids=["greedy", "seeded"])
def test_lookahead_under_a_grammar_emits_plain_constrained_decoding(
    peaky, tokenizer, compiler, kind, sampling
) -> None:
    prompt = tokenizer.encode("Answer: ")
    params = SamplingParams(max_tokens=40, structured_outputs=CONSTRAINTS[kind], **sampling)
    eos = (tokenizer.eos_token_id,)
    trie = NGramTrie(capacity=100_000, max_depth=12)
    decoder = LookaheadDecoder(peaky, tokenizer, trie, LookaheadConfig(adaptive=False), eos)
    plain = run(decoder, prompt, params, LookaheadConfig(use_lookahead=False))
    assert plain.finish_reason == "stop", tokenizer.decode(plain.output_ids)
    # Drafts: the model's own constrained output (accepted) and branches the grammar forbids,
    # where retrieval looks: after the prompt, and after the text the grammar forces first.
    forced = GrammarMatcher(compiler.compile(CONSTRAINTS[kind]), VOCAB).forced()
    for context in {tuple(prompt[-3:]), tuple((prompt + forced)[-3:])}:
        for noise in ([11, 12, 13], tokenizer.encode(" nope {]"), [plain.output_ids[0], 7, 7]):
            trie.insert([*context, *noise])
    trie.insert(prompt[-3:] + plain.output_ids)
    drafted = run(decoder, prompt, params)
    assert drafted.output_ids == plain.output_ids
    assert drafted.finish_reason == "stop"
    assert conforms(kind, tokenizer.decode(drafted.output_ids, skip_special_tokens=True))
    assert drafted.stats.accepted_draft_tokens > 0
    assert drafted.selector.grammar.stats.pruned_nodes > 0


def test_each_draft_path_is_admitted_by_the_state_of_its_own_branch(compiler, tokenizer) -> None:
    spec = StructuredOutputs("choice", json.dumps(["yes!", "no?"]))
    matcher = GrammarMatcher(compiler.compile(spec), VOCAB)
    yes, no, bang, ask = (tokenizer.encode(t)[0] for t in ("yes", "no", "!", "?"))
    assert tokenizer.encode("yes!") == [yes, bang] and tokenizer.encode("no?") == [no, ask]
    # asked in best-first order, jumping between branches as retrieval does
    answers = [
        matcher.admits(path)
        for path in ((yes,), (no,), (bang,), (yes, ask), (no, ask), (yes, bang), (no, bang))
    ]
    assert answers == [True, True, False, False, True, True, False]
    assert matcher.stats.checked_nodes == 7 and matcher.stats.pruned_nodes == 3


def test_retrieval_drafts_what_the_grammar_admits_in_place_of_what_it_forbids(compiler, tokenizer) -> None:
    spec = StructuredOutputs("choice", json.dumps(["yes!", "no?"]))
    yes, no, bang, ask = (tokenizer.encode(t)[0] for t in ("yes", "no", "!", "?"))
    trie = NGramTrie(capacity=1000, max_depth=4)
    for _ in range(5):  # after token 3 the trie mostly saw "no!" (forbidden), once "yes!"
        trie.insert([3, no, bang])
    trie.insert([3, yes, bang])
    for mode in DECODING_MODES:
        blind = retrieve_draft([3], trie, None, decoding_length=3, branch_length=2, mode=mode)
        assert blind.tokens[:3] == [3, no, bang]
        matcher = GrammarMatcher(compiler.compile(spec), VOCAB)
        drafted = retrieve_draft(
            [3], trie, None, decoding_length=3, branch_length=2, mode=mode, admits=matcher.admits
        )
        expected = [3, no] if mode == "one" else [3, no, yes]  # `one` stops where no child is admitted
        assert drafted.tokens == expected
        assert all(matcher.admits(tuple(path)) for path in _draft_paths(drafted))


def test_text_the_grammar_forces_is_drafted_as_certain_with_an_empty_trie(peaky, tokenizer, compiler) -> None:
    spec = CONSTRAINTS["json"]
    forced = GrammarMatcher(compiler.compile(spec), VOCAB).forced()
    assert tokenizer.decode(forced) == '{"color":"'
    prompt = tokenizer.encode("Answer: ")
    params = SamplingParams(max_tokens=40, structured_outputs=spec)
    eos = (tokenizer.eos_token_id,)
    decoder = LookaheadDecoder(peaky, tokenizer, NGramTrie(100_000, 12), LookaheadConfig(adaptive=False), eos)
    draft = decoder.start(prompt, params).retrieve(max_width=16)
    assert draft.tokens == [prompt[-1], *forced]  # nothing learned yet: the grammar's text alone
    assert draft.origins[1:] == [FROM_GRAMMAR] * len(forced) and draft.probs == [1.0] * len(draft)
    plain = run(decoder, prompt, params, LookaheadConfig(use_lookahead=False))
    drafted = run(decoder, prompt, params)
    assert drafted.output_ids == plain.output_ids
    assert conforms("json", tokenizer.decode(drafted.output_ids, skip_special_tokens=True))


def test_retrieval_conditions_its_estimates_on_the_grammar(compiler, tokenizer) -> None:
    # The trie mostly saw "no" after token 3, once "yes"; the grammar allows only "yes!". The
    # model cannot say "no", so "yes" gets the estimate conditioned on that: p(yes) / (1 - p(no)).
    spec = StructuredOutputs("choice", json.dumps(["yes!"]))
    yes, no, bang = (tokenizer.encode(t)[0] for t in ("yes", "no", "!"))
    trie = NGramTrie(capacity=1000, max_depth=4)
    for _ in range(5):
        trie.insert([3, no, bang])
    trie.insert([3, yes, bang])
    blind = retrieve_draft([3], trie, None, decoding_length=4, branch_length=1, mode="hier")
    p_no, p_yes = blind.probs[blind.tokens.index(no)], blind.probs[blind.tokens.index(yes)]
    assert p_no > 0.5 > p_yes > 0
    for mode in DECODING_MODES:
        matcher = GrammarMatcher(compiler.compile(spec), VOCAB)
        drafted = retrieve_draft(
            [3], trie, None, decoding_length=4, branch_length=1, mode=mode, admits=matcher.admits
        )
        assert drafted.tokens == [3, yes]
        assert drafted.probs[1] == pytest.approx(p_yes / (1 - p_no))


def _draft_paths(draft: Draft) -> list[list[int]]:
    paths: list[list[int]] = [[]]
    for i in range(1, len(draft)):
        paths.append([*paths[draft.parents[i]], draft.tokens[i]])
    return paths[1:]


def test_each_row_is_masked_with_the_state_of_its_own_branch(compiler, tokenizer) -> None:
    spec = StructuredOutputs("choice", json.dumps(["yes!", "no?"]))
    matcher = GrammarMatcher(compiler.compile(spec), VOCAB)
    yes, no, bang, ask = (tokenizer.encode(t)[0] for t in ("yes", "no", "!", "?"))
    cpu = torch.device("cpu")
    at_root = matcher.allowed([], cpu)
    assert at_root[yes] and at_root[no] and not at_root[bang]
    after_yes = matcher.allowed([yes], cpu)
    after_no = matcher.allowed([no], cpu)  # rolled back from yes's branch, onto no's
    assert after_yes[bang] and not after_yes[ask] and after_yes.sum() == 1
    assert after_no[ask] and not after_no[bang] and after_no.sum() == 1
    assert torch.equal(matcher.allowed([yes], cpu), after_yes)
    matcher.commit([yes, bang])
    assert matcher.allowed([], cpu).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_a_grammar_that_cannot_finish_ends_with_length(peaky, tokenizer) -> None:
    spec = StructuredOutputs("regex", "[a-z]{200}")
    decoder = LookaheadDecoder(peaky, tokenizer, None, LookaheadConfig(), (tokenizer.eos_token_id,))
    gen = run(decoder, tokenizer.encode("x"), SamplingParams(max_tokens=6, structured_outputs=spec))
    assert gen.finish_reason == "length" and len(gen.output_ids) == 6
    assert re.fullmatch("[a-z]+", tokenizer.decode(gen.output_ids))


def test_min_tokens_yields_to_a_complete_grammar(peaky, tokenizer) -> None:
    spec = StructuredOutputs("choice", json.dumps(["delta"]))
    decoder = LookaheadDecoder(peaky, tokenizer, None, LookaheadConfig(), (tokenizer.eos_token_id,))
    params = SamplingParams(max_tokens=8, min_tokens=4, structured_outputs=spec)
    gen = run(decoder, tokenizer.encode("x"), params)
    assert tokenizer.decode(gen.output_ids, skip_special_tokens=True) == "delta"
    assert gen.output_ids[-1] == tokenizer.eos_token_id and gen.finish_reason == "stop"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs("regex", "(ab"), "structured_outputs.regex: .*unclosed group"),
        (StructuredOutputs("json", json.dumps({"type": "objectx"})), "structured_outputs.json: .*objectx"),
        (
            StructuredOutputs("grammar", "start: undefined_rule", key="guided_decoding"),
            "guided_decoding.grammar: ",
        ),
        (StructuredOutputs("regex", "(?=a)b", key="guided_regex"), "guided_regex: .*look-around"),
    ],
)
def test_a_bad_constraint_is_refused_naming_its_key_and_reason(compiler, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_compiles_are_cached_per_constraint(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], VOCAB, timeout_s=30)
    spec = StructuredOutputs("json", json.dumps(SCHEMA))
    assert compiler.compile(spec) is compiler.compile(StructuredOutputs("json", json.dumps(SCHEMA)))
    assert compiler.cached(StructuredOutputs("json", json.dumps(SCHEMA), key="guided_json")) is not None
    assert compiler.cached(StructuredOutputs("json", json.dumps({"type": "integer"}))) is None


def test_the_default_model_extracts_json_that_parses_losslessly(default_model) -> None:
    tokenizer = default_model.tokenizer
    decoder = LookaheadDecoder.for_model(default_model)
    prompt = json_extraction_prompts(1)[0]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.instruction}], add_generation_prompt=True, return_dict=False
    )
    params = SamplingParams(
        max_tokens=96, structured_outputs=StructuredOutputs("json", json.dumps(prompt.schema))
    )
    plain = run(decoder, ids, params, LookaheadConfig(use_lookahead=False))
    drafted = run(decoder, ids, params)
    assert drafted.output_ids == plain.output_ids
    assert drafted.finish_reason == "stop"
    assert (
        schema_errors(
            json.loads(tokenizer.decode(drafted.output_ids, skip_special_tokens=True)), prompt.schema
        )
        == []
    )
    assert drafted.stats.accepted_draft_tokens > 0
    assert drafted.stats.steps < len(drafted.output_ids) - 1


def test_schema_errors_finds_what_breaks_a_schema() -> None:
    schema = json_extraction_prompts(2)[1].schema  # an order: nested objects in an array
    good = {
        "order_id": "A-1",
        "customer": "Ada",
        "items": [{"product": "webcam", "quantity": 2}],
        "express": True,
    }
    assert schema_errors(good, schema) == []
    bad = {"order_id": 7, "customer": "Ada", "items": [{"product": "webcam", "quantity": True}] * 4, "x": 1}
    assert schema_errors(bad, schema) == [
        "$: missing express",
        "$.order_id: expected string, got int",
        "$.items: more than 3 items",
        *["$.items[%d].quantity: expected integer, got bool" % i for i in range(4)],
        "$: unexpected x",
    ]
