"""`python -m scripts.stall_test`: see client.stall_test."""

from client.stall_test import main

if __name__ == "__main__":
    raise SystemExit(main())
