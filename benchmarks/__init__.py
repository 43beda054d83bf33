"""Side-by-side benchmarks; `python -m benchmarks run [--quick]` writes RESULTS.md and results.json."""
