"""Benchmarks: each prints one final JSON line with figures measured side by side. Run as `python -m
benchmarks.NAME`."""
