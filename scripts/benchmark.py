"""`python -m scripts.benchmark`: see lookahead.benchmarks.decoding."""

from lookahead.benchmarks.decoding import main

if __name__ == "__main__":
    raise SystemExit(main())
