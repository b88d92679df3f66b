"""`python -m scripts.bench_grammar`: see lookahead.benchmarks.grammar_cost."""

from lookahead.benchmarks.grammar_cost import main

if __name__ == "__main__":
    raise SystemExit(main())
