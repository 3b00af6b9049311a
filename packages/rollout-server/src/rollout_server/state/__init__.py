"""What the server knows about each rollout: the registry (the single writer of rollout
records, and the only publisher of a rollout's end), the records themselves, the long-poll
waits, the deadline queue behind leases and retention, and the pre-encoded JSON bodies a
record hands to a poll.

It owns rollout state and its timing; it knows neither HTTP nor backends. It may import
``observability`` and the shared top-level modules only (import-linter checks it).
"""
