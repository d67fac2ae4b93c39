"""Benchmarks: `python -m bench` (see __main__.py). Speed is measured here, never in the tests."""
