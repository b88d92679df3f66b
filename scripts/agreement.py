"""`python -m scripts.agreement`: see lookahead.benchmarks.agreement."""

from lookahead.benchmarks.agreement import main

if __name__ == "__main__":
    raise SystemExit(main())
