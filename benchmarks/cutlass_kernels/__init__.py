"""Benchmarks: scripts that compare side by side in one run and write JSON."""
