"""Helpers shared by the test suite and the benchmarks (tiny random models, reference generation)."""
