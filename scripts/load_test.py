"""`python -m scripts.load_test`: see client.load_test."""

from client.load_test import main

if __name__ == "__main__":
    raise SystemExit(main())
