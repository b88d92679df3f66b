"""What outlives a server process: trie snapshots (persistence.py) and warm-up corpora (warmup.py)."""
