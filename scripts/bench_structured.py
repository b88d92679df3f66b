"""`python -m scripts.bench_structured`: see client.structured_bench."""

from client.structured_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
