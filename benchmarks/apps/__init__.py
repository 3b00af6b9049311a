"""The benchmark's trivial workflow and grader, as an app of each stack.

``ours_app`` serves them with ``rollout-server serve``; ``osmosis_serve`` serves them on
osmosis-ai 0.3.8 under uvicorn. Both share :mod:`benchmarks.apps.behaviour`.
"""
