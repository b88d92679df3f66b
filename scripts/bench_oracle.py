"""`python -m scripts.bench_oracle`: see lookahead.benchmarks.oracle_bound."""

from lookahead.benchmarks.oracle_bound import main

if __name__ == "__main__":
    raise SystemExit(main())
