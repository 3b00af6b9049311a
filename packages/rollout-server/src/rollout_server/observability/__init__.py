"""How the server reports on itself, below every layer that reports: OpenTelemetry tracing
(spans, context propagation, the optional ``[otel]`` extra), JSON log formatting, and the
:class:`~rollout_server.ExecutionObserver` seam through which backends report phase times.
The Prometheus metrics that read the registry live in ``protocol`` (they observe state).

It is the only subpackage that imports ``opentelemetry``. It may import only the shared
top-level modules (import-linter checks it).
"""
