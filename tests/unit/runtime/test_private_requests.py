"""A request with `learn` off teaches nothing shared: the trie, the recycle table, the acceptance
predictor, the prefix cache. A later request continuing its secret is no faster for it than one
continuing a control string that was never sent."""

from __future__ import annotations

from dataclasses import replace

from lookahead import LookaheadConfig, LookaheadDecoder, NGramTrie, SamplingParams
from lookahead.algorithm.acceptance import AcceptancePredictor
from tests.helpers import plain_greedy

SECRETS = [
    b"the vault code is 7419 and the door opens at dawn",
    b"my password is hunter2, do not tell anyone ever",
    b"launch key: orange-falcon-93 under the blue mat",
]
CONTROL = b"seven quiet lanterns drift past the old stone mill"
RECYCLED = LookaheadConfig(drafter="recycled", decoding_length=12, branch_length=6, adaptive=False)
PRIVATE = replace(RECYCLED, learn=False)
TOKENS = 24
GREEDY = SamplingParams(max_tokens=TOKENS, ignore_eos=True)


def steps(decoder: LookaheadDecoder, text: bytes) -> int:
    """Decoding steps a recycled-only request takes to continue `text`."""
    ids, stats = decoder.generate(list(text), GREEDY, RECYCLED)
    assert len(ids) == TOKENS
    return stats.steps


def test_a_private_secret_is_no_faster_to_continue_than_a_control(tiny_model, byte_tokenizer) -> None:
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None

    def decoder() -> LookaheadDecoder:
        return LookaheadDecoder(model, byte_tokenizer, NGramTrie(capacity=10_000, max_depth=9), RECYCLED)

    untaught = {"secret": 0, "control": 0}  # steps on an instance that saw no probe
    probed = {"secret": 0, "control": 0}  # steps after the private probe of the secret
    traces = []
    initial = AcceptancePredictor().weights
    for secret in SECRETS:
        for name, text in (("secret", secret), ("control", CONTROL)):
            untaught[name] += steps(decoder(), text)
            instance = decoder()
            probe = list(secret + b" " + secret)  # the private request repeats the secret
            ids, stats = instance.generate(probe, GREEDY, PRIVATE)
            assert stats.accepted_draft_tokens > 0  # it drafted from recycled rows of its own
            if secret is SECRETS[0] and name == "secret":
                assert ids == plain_greedy(model, probe, TOKENS)
            table = instance.recycled
            traces.append(
                {
                    "recycled rows": int((table.written >= 0).sum()) + table.updates,
                    "acceptance weights": int((instance.acceptance.weights != initial).sum()),
                    "trie nodes": instance.trie.node_count,
                    "prefix cache tokens": instance.runner.prefix_cache.tokens,
                }
            )
            probed[name] += steps(instance, text)
    # The leak this guards against: a table taught by the probe continues the secret in fewer steps.
    assert probed == untaught, f"after the probe {probed}, without it {untaught}"
    assert all(not any(trace.values()) for trace in traces), traces
