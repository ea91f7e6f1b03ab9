"""Benchmarks (timed runs under the emulated link); kept apart from the correctness tests."""
