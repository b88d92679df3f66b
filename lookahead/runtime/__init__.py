"""The batched step runtime: a request's path from prompt to streamed text.

`decoder.LookaheadDecoder` drives one step for every running `generation.Generation`: the
`scheduler` decides what each request feeds within the step's token budget (no torch), the
`runner` feeds it all in one forward (`step_inputs` lays the segments out as one ragged row with
a tree mask, `kv_pool` holds every request's KV in one buffer, `prefix_cache` keeps recent
prompts' KV), `sampling` picks tokens with vLLM's semantics, and `detokenizer` turns accepted ids
into text deltas.
"""
