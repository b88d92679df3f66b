"""How far could any drafter go on this machine? An upper bound for lookahead over plain decoding.

Plain greedy outputs of a prompt set (as the load test sends them: a chat set in the model's chat
template, `ignore_eos`, `--max-tokens`), then an oracle that knows each output: at every step it
drafts exactly the longest run of the coming tokens (at most 31) that followed an earlier
occurrence of the last token, in the request's own prompt and output so far (`own text`), or also
in every earlier request's text (`shared`, as the global trie learns it), and nothing else. A step
is priced with the measured forward-cost curve of the path the model runs on (the packed kernel's
variant; under `scripts/as_avx2.sh`, AVX2's), and drafting costs nothing: only the forward counts.
At concurrency c, groups of c requests step together (the next request taking a finished one's
place): a step costs cost(sum of their widths) where plain decoding pays cost(c) for c tokens, and
the oracle caps the runs at the length that makes the step cheapest per token.

No real drafter knows the output, so what lookahead reaches lies below these ratios.

    python -m bench oracle_bound --prompt-set code_edit --prompts 16
    scripts/as_avx2.sh .venv/bin/python -m bench oracle_bound --prompt-set code_edit --prompts 16
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence

from lookahead.algorithm.cost_priors import STOCK_CPU_PRIOR
from lookahead.config import DecoderConfig, LookaheadConfig, SamplingParams
from lookahead.models.chat import chat_prompt
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_model
from lookahead.runtime.decoder import LookaheadDecoder

from .prompt_sets import PROMPT_SET_NAMES, load_prompt_set

LONGEST_RUN = 31  # the default branch_length's draft, less one
CAPS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, LONGEST_RUN)


def best_runs(prompt: list[int], output: list[int], earlier: Sequence[list[int]]) -> list[int]:
    """For every output position t, the longest run of output[t:] that followed an earlier
    occurrence of the token before t, in the text known by then or in `earlier` texts."""
    text = [*prompt, *output]
    after: dict[int, list[tuple[list[int], int]]] = defaultdict(list)  # token -> (text, position after it)
    for other in earlier:
        for j in range(1, len(other)):
            after[other[j - 1]].append((other, j))
    runs = []
    for t in range(len(prompt), len(text)):
        best = 0
        own = [(text, j) for j in range(1, t) if text[j - 1] == text[t - 1]]
        for source, j in own + after[text[t - 1]]:
            end = t if source is text else len(source)  # the own text only as far as it is known
            n = 0
            while n < LONGEST_RUN and t + n < len(text) and j + n < end and source[j + n] == text[t + n]:
                n += 1
            best = max(best, n)
        runs.append(best)
    return runs


def relative_cost(curve: dict[int, float], q: int) -> float:
    """cost(q) / cost(1), linear between the curve's points."""
    points = sorted(curve)
    for lower, upper in zip(points, points[1:]):
        if q <= upper:
            return curve[lower] + (q - lower) * (curve[upper] - curve[lower]) / (upper - lower)
    return curve[points[-1]] * q / points[-1]


def forward_cost(runs: list[list[int]], concurrency: int, curve: dict[int, float], draft: bool) -> float:
    """The summed relative cost of the forwards that decode every request, `concurrency` at a
    time, a finished request's place taken by the next (as a closed-loop client keeps them);
    `draft`: the oracle's runs, else plain decoding."""
    queue = list(range(len(runs)))[::-1]
    running = {queue.pop(): 0 for _ in range(min(concurrency, len(queue)))}  # request -> position
    total = 0.0
    while running:
        best = [min(runs[r][t], len(runs[r]) - t - 1) if draft else 0 for r, t in running.items()]
        widths = min(
            ([min(b, cap) + 1 for b in best] for cap in CAPS),
            key=lambda widths: relative_cost(curve, sum(widths)) / sum(widths),
        )
        total += relative_cost(curve, sum(widths))
        for r, width in zip(list(running), widths):
            running[r] += width
            if running[r] >= len(runs[r]):
                del running[r]
                if queue:
                    running[queue.pop()] = 0
    return total


def oracle_ratio(runs: list[list[int]], concurrency: int, curve: dict[int, float]) -> float:
    """Plain decoding's forward cost over the oracle's, for the same requests at one concurrency."""
    return forward_cost(runs, concurrency, curve, False) / forward_cost(runs, concurrency, curve, True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompt-set", default="code_edit", choices=PROMPT_SET_NAMES)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,2,4,8")
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer
    prompt_set = load_prompt_set(args.prompt_set)
    texts = list(prompt_set.prompts[: args.prompts])
    if prompt_set.use_chat_template:
        texts = [chat_prompt(tokenizer, [{"role": "user", "content": text}]) for text in texts]
    plain = LookaheadDecoder.for_model(loaded, None, LookaheadConfig(use_lookahead=False), DecoderConfig())
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    requests = []
    for text in texts:
        prompt = tokenizer.encode(text)
        generation = plain.start(prompt, params)
        while not generation.finished:
            generation.step()
        requests.append((prompt, generation.output_ids))
    curve = loaded.cost_prior or STOCK_CPU_PRIOR
    own = [best_runs(prompt, output, []) for prompt, output in requests]
    shared = [best_runs(p, o, [[*q, *r] for q, r in requests[:i]]) for i, (p, o) in enumerate(requests)]
    print(f"{args.prompt_set}, {len(requests)} prompts, {args.max_tokens} tokens, {loaded.execution}")
    print("concurrency | oracle on own text (x plain) | oracle on own and earlier text (x plain)")
    for level in (int(c) for c in args.concurrency.split(",")):
        bounds = oracle_ratio(own, level, curve), oracle_ratio(shared, level, curve)
        print(f"{level:11d} | {bounds[0]:28.2f} | {bounds[1]:.2f}")
    return 0
