"""Command-line tools around the library: benchmarks and their prompt sets."""
