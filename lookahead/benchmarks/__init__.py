"""Benchmarks of the library, in-process (no server): decoding speed against transformers' greedy
and prompt lookup decoding (decoding.py), the forward's cost by tokens fed (forward_cost.py) and
trie retrieval cost (retrieval_cost.py), on prompt sets that pip packages ship (prompt_sets.py).
Run them as `python -m scripts.benchmark` and so on."""
