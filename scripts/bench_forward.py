"""`python -m scripts.bench_forward`: see lookahead.benchmarks.forward_cost."""

from lookahead.benchmarks.forward_cost import main

if __name__ == "__main__":
    raise SystemExit(main())
