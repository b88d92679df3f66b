"""`python -m scripts.bench_roofline`: see lookahead.benchmarks.roofline."""

from lookahead.benchmarks.roofline import main

if __name__ == "__main__":
    raise SystemExit(main())
