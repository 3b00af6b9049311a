"""Benchmarks of our rollout stack side by side with osmosis-ai 0.3.8 (``nox -s bench``).

Every module here uses only the standard library at import time, so the load generator
runs unchanged in the osmosis-ai venv and in ours.
"""
