"""What the server knows about each rollout: the registry (the single writer of rollout
records, and the only publisher of a rollout's end), the records themselves, the long-poll
waits, the deadline queue behind leases and retention, the pre-encoded JSON bodies a
record hands to a poll, and the state stores that keep rollouts across a restart (the
``StateStore`` protocol, ``memory:`` and the SQLite file; only this subpackage imports
``sqlite3``).

It owns rollout state and its timing; it knows neither HTTP nor backends. It may import
``observability`` and the shared top-level modules only (import-linter checks it).
"""
