"""Benchmarks and load generators; each prints figures and writes JSON."""
