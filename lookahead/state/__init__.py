"""What outlives a server process or one instance: trie snapshots (persistence.py), warm-up corpora
(warmup.py), the trie's life between steps (keeper.py) and the fleet's shared stream (sync.py)."""
