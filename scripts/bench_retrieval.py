"""`python -m scripts.bench_retrieval`: see lookahead.benchmarks.retrieval_cost."""

from lookahead.benchmarks.retrieval_cost import main

if __name__ == "__main__":
    raise SystemExit(main())
