"""The batched step runtime: a request's path from prompt to streamed text.

`decoder.LookaheadDecoder` runs one forward per step for every running `generation.Generation`:
`step_inputs` lays the drafts out as one [k, q] block with a tree mask, `kv_pool` holds every
request's KV in one buffer (with `prefix_cache` keeping recent prompts' KV), `sampling` picks
tokens as transformers' generate() would, and `detokenizer` turns accepted ids into text deltas.
"""
