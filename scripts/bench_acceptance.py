"""`python -m scripts.bench_acceptance`: see lookahead.benchmarks.acceptance."""

from lookahead.benchmarks.acceptance import main

if __name__ == "__main__":
    raise SystemExit(main())
