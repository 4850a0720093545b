"""Benchmarks: each prints a table and is run by hand (``python -m benchmarks.NAME``)."""
