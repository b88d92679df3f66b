"""`python -m scripts.speedup`: see client.speedup."""

from client.speedup import main

if __name__ == "__main__":
    raise SystemExit(main())
