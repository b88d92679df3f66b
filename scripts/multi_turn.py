"""`python -m scripts.multi_turn`: see client.multi_turn."""

from client.multi_turn import main

if __name__ == "__main__":
    raise SystemExit(main())
