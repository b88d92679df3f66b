"""Model I/O: embedded models by name (embedded.py), loading (loading.py), load-time checks
(checks.py) and chat prompts (chat.py)."""
