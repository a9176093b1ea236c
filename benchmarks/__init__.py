"""Benchmarks: overhead, memory and checkpoint cost (see RESULTS.md)."""
