"""Benchmarks: ``python -m bench.planner`` (see bench/README.md)."""
