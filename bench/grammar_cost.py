"""What a grammar costs a lookahead step, in one process: the default model extracts JSON under
each prompt's schema (bench/json_extraction.py), greedy, and the matcher's own
counters give the time to check draft nodes (pruning, per node and per step) and to compute the
masks of the verified rows (per mask and per step), next to the step's forward. Compile time is
measured per schema, the first compile of the process (llguidance's tokenizer view) apart.

    python -m bench grammar_cost --prompts 4
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from lookahead.config import SamplingParams, StructuredOutputs
from lookahead.models.embedded import DEFAULT_MODEL
from lookahead.models.loading import load_model
from lookahead.runtime.decoder import LookaheadDecoder

from .json_extraction import json_extraction_prompts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=192)
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    decoder = LookaheadDecoder.for_model(loaded)
    tokenizer = loaded.tokenizer
    started = time.perf_counter()
    decoder.grammars.tokenizer()
    print(f"tokenizer view: {1e3 * (time.perf_counter() - started):.0f} ms (once per model)")
    totals = dict(steps=0, forward=0.0, masks=0, mask=0.0, nodes=0, pruned=0, prune=0.0)
    for prompt in json_extraction_prompts(args.prompts):
        spec = StructuredOutputs("json", json.dumps(prompt.schema))
        started = time.perf_counter()
        decoder.grammars.compile(spec)
        compile_ms = 1e3 * (time.perf_counter() - started)
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.instruction}], add_generation_prompt=True, return_dict=False
        )
        gen = decoder.start(ids, SamplingParams(max_tokens=args.max_tokens, structured_outputs=spec))
        while not gen.finished:
            gen.step()
        stats, grammar = gen.stats, gen.selector.grammar.stats
        print(
            f"compile {compile_ms:.1f} ms; {stats.output_tokens} tokens in {stats.steps} steps; "
            f"{grammar.masks} masks {1e6 * grammar.mask_seconds / max(grammar.masks, 1):.0f} us each; "
            f"{grammar.checked_nodes} draft nodes checked ({grammar.pruned_nodes} pruned) "
            f"{1e6 * grammar.prune_seconds / max(grammar.checked_nodes, 1):.1f} us each"
        )
        totals["steps"] += stats.steps + 1  # the prefill verifies a draft too
        totals["forward"] += sum(stats.forward_seconds) + stats.prefill_seconds
        totals["masks"] += grammar.masks
        totals["mask"] += grammar.mask_seconds
        totals["nodes"] += grammar.checked_nodes
        totals["pruned"] += grammar.pruned_nodes
        totals["prune"] += grammar.prune_seconds
    steps = totals["steps"]
    print(
        f"per step: forward and verification {1e3 * totals['forward'] / steps:.1f} ms (prefills included), "
        f"masks "
        f"{1e3 * totals['mask'] / steps:.2f} ms ({totals['masks'] / steps:.1f} rows), pruning "
        f"{1e3 * totals['prune'] / steps:.2f} ms ({totals['nodes'] / steps:.1f} nodes, "
        f"{totals['pruned'] / max(totals['nodes'], 1):.0%} pruned)"
    )
    return 0
