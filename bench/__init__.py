"""Benchmarks: the pure core (core.py) and the running service (service.py)."""
