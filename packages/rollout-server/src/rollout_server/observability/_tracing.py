"""OpenTelemetry traces of rollouts (``pip install 'rollout-server[otel]'``), free when off.

The spans of a traced server (tracer ``rollout_server``), each with ``rollout.id``:

* ``POST /rollout`` (kind SERVER): one per admission request, continuing the caller's
  trace (its ``traceparent``); ``http.request.method``, ``http.route``,
  ``http.response.status_code``;
* ``rollout``: child of its admission, from admission to publication; ``rollout.status``
  and ``rollout.err_category`` (status ERROR unless the rollout succeeded or was
  cancelled). Its children: ``queue`` (waiting for a LocalBackend slot), ``workflow``,
  ``grading``, ``trajectory write``, and ``publish`` (the moment the result is fixed, with
  the status and category);
* ``chat`` / ``chat <model>`` (kind CLIENT): one per model call a workflow makes inside
  :meth:`RolloutContext.model_call() <rollout_server.RolloutContext.model_call>`, child of
  ``workflow``; the block's headers carry that span's ``traceparent``, so the spans of a
  model server that reads it (vLLM with ``--otlp-traces-endpoint``) join the same trace.

Which tracer provider a server uses (:func:`default_tracer_provider`): the one passed to
``create_rollout_server(tracer_provider=...)``; else the process's global provider when
one has been set (``opentelemetry-instrument``, or the program's own set-up); else one
configured from the standard ``OTEL_*`` environment variables when they ask for an
exporter (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_TRACES_EXPORTER``), or from ``OSMOSIS_ROLLOUT_OTLP_ENDPOINT`` as osmosis-ai servers
read it (OTLP/HTTP to ``<endpoint>/v1/traces``), which then becomes the global provider;
else none, and nothing is traced or exported.

While no server of the process traces, the helpers used on the rollout path
(:func:`phase_span`, :func:`start_span`, :func:`model_call`, :func:`current_trace_ids`)
return at once without importing OpenTelemetry: one module-level check.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from .._logtext import get_logger
from .._version import VERSION

__all__ = [
    "OSMOSIS_OTLP_ENDPOINT_ENV",
    "ROLLOUT_ID_ATTRIBUTE",
    "ServerTracing",
    "current_trace_ids",
    "default_tracer_provider",
    "end_span",
    "model_call",
    "phase_span",
    "provider_from_environment",
    "set_outcome",
    "start_span",
]

logger: Final = get_logger("rollout_server.tracing")

OSMOSIS_OTLP_ENDPOINT_ENV: Final = "OSMOSIS_ROLLOUT_OTLP_ENDPOINT"
"""Base URL of an OTLP/HTTP collector, as osmosis-ai servers read it (traces go to
``<endpoint>/v1/traces``); the standard ``OTEL_EXPORTER_OTLP_*`` variables win."""

SERVICE_NAME: Final = "rollout-server"
"""``service.name`` of a provider configured here, unless ``OTEL_SERVICE_NAME`` or
``OTEL_RESOURCE_ATTRIBUTES`` names the service."""

ROLLOUT_ID_ATTRIBUTE: Final = "rollout.id"
STATUS_ATTRIBUTE: Final = "rollout.status"
CATEGORY_ATTRIBUTE: Final = "rollout.err_category"

_INSTALL_HINT: Final = "pip install 'rollout-server[otel]'"


class _Api:
    """The OpenTelemetry API modules, imported once a server of this process traces."""

    def __init__(self) -> None:
        from opentelemetry import context, propagate, trace

        self.context = context
        self.propagate = propagate
        self.trace = trace
        self.tracer_key = context.create_key("rollout_server.tracer")
        """Where a rollout's context keeps its server's tracer (for the phase and model-call
        spans below it, whichever provider that server uses)."""


_api: _Api | None = None
"""Set once a server of this process traces; until then every helper is a no-op."""

_NO_SPAN: Final = contextlib.nullcontext()


def _load() -> _Api:
    global _api
    if _api is None:
        _api = _Api()
    return _api


def _rollout_tracer() -> Any:
    """The tracer of the server running the current rollout, or None."""
    api = _api
    if api is None:
        return None
    return api.context.get_value(api.tracer_key)


# Speed: benchmarks/README.md, "Server: observability", row "Tracing free when off ..."
def phase_span(name: str, rollout_id: str) -> contextlib.AbstractContextManager[Any]:
    """A span around one phase of a rollout (made current inside the ``with`` block), or a
    no-op when the rollout is not traced.

    Args:
        name: The span name (``queue``, ``workflow``, ``grading``).
        rollout_id: The ``rollout.id`` attribute.
    """
    tracer = _rollout_tracer()
    if tracer is None:
        return _NO_SPAN
    span_cm: contextlib.AbstractContextManager[Any] = tracer.start_as_current_span(
        name, attributes={ROLLOUT_ID_ATTRIBUTE: rollout_id}
    )
    return span_cm


def set_outcome(span: Any, status: object, category: object = None) -> None:
    """Give a phase's span (None: not traced) the phase's status and error category; a
    ``failure`` marks the span as failed."""
    if span is None:
        return
    span.set_attribute(STATUS_ATTRIBUTE, str(status))
    if category is not None:
        span.set_attribute(CATEGORY_ATTRIBUTE, str(category))
    if str(status) == "failure":
        api = _load()
        span.set_status(api.trace.Status(api.trace.StatusCode.ERROR, str(category)))


# Speed: benchmarks/README.md, "Server: observability", row "Tracing free when off ..."
def start_span(name: str, rollout_id: str) -> Any:
    """Start a span of the current rollout that ends elsewhere (:func:`end_span`); None when
    the rollout is not traced."""
    tracer = _rollout_tracer()
    if tracer is None:
        return None
    return tracer.start_span(name, attributes={ROLLOUT_ID_ATTRIBUTE: rollout_id})


def end_span(span: Any, error: BaseException | None = None) -> None:
    """End a span from :func:`start_span` (None: nothing to do), failed with ``error``."""
    if span is None:
        return
    if error is not None:
        api = _load()
        span.record_exception(error)
        span.set_status(api.trace.Status(api.trace.StatusCode.ERROR, str(error)))
    span.end()


# Speed: benchmarks/README.md, "Server: observability", row "Tracing free when off ..."
def model_call(
    rollout_id: str, model: str | None = None
) -> contextlib.AbstractContextManager[dict[str, str]]:
    """The span of one model call and the headers that carry it (see
    :meth:`RolloutContext.model_call() <rollout_server.RolloutContext.model_call>`).

    Returns:
        A context manager whose value is a new dict of headers to send with the request:
        ``traceparent`` (and ``tracestate``) of a CLIENT span that lasts for the block,
        or empty when the rollout is not traced.
    """
    tracer = _rollout_tracer()
    if tracer is None:
        return contextlib.nullcontext({})
    return _model_call(_load(), tracer, rollout_id, model)


@contextlib.contextmanager
def _model_call(
    api: _Api, tracer: Any, rollout_id: str, model: str | None
) -> Iterator[dict[str, str]]:
    attributes = {ROLLOUT_ID_ATTRIBUTE: rollout_id, "gen_ai.operation.name": "chat"}
    if model:
        attributes["gen_ai.request.model"] = model
    name = f"chat {model}" if model else "chat"
    with tracer.start_as_current_span(name, kind=api.trace.SpanKind.CLIENT, attributes=attributes):
        headers: dict[str, str] = {}
        api.propagate.inject(headers)
        yield headers


# Speed: benchmarks/README.md, "Server: observability", row "Tracing free when off ..."
def current_trace_ids() -> tuple[str, str] | None:
    """``(trace_id, span_id)`` in hex of the span current here, or None (no valid span, or
    nothing traced in this process)."""
    api = _api
    if api is None:
        return None
    span_context = api.trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return format(span_context.trace_id, "032x"), format(span_context.span_id, "016x")


# -- the server's spans ---------------------------------------------------------------------


class _Admission:
    """The ``POST /rollout`` span while the admission is answered."""

    __slots__ = ("_api", "_span", "_token")

    def __init__(self, api: _Api, span: Any) -> None:
        self._api = api
        self._span = span
        self._token: object = None

    def __enter__(self) -> Callable[[int], None]:
        api = self._api
        self._token = api.context.attach(api.trace.set_span_in_context(self._span))
        return self.answered

    def answered(self, status: int) -> None:
        span = self._span
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(self._api.trace.StatusCode.ERROR)

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        self._api.context.detach(self._token)
        if exc is not None:
            self.answered(500)
            self._span.record_exception(exc)
        self._span.end()


class _RolloutScope:
    """Makes a new ``rollout`` span current (with its server's tracer) while the rollout's
    execution task is created, so the task's context carries both."""

    __slots__ = ("_record", "_token", "_tracing")

    def __init__(self, tracing: ServerTracing, record: Any) -> None:
        self._tracing = tracing
        self._record = record
        self._token: object = None

    def __enter__(self) -> None:
        tracing = self._tracing
        api = tracing.api
        rollout_id = self._record.rollout_id
        api.trace.get_current_span().set_attribute(ROLLOUT_ID_ATTRIBUTE, rollout_id)
        span = tracing.tracer.start_span("rollout", attributes={ROLLOUT_ID_ATTRIBUTE: rollout_id})
        tracing.spans[self._record] = span
        context = api.context.set_value(
            api.tracer_key, tracing.tracer, api.trace.set_span_in_context(span)
        )
        self._token = api.context.attach(context)

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        tracing = self._tracing
        tracing.api.context.detach(self._token)
        if exc is not None:  # no execution task: the rollout was not admitted after all
            end_span(tracing.spans.pop(self._record, None), exc)


class ServerTracing:
    """The spans of one rollout server: admission, rollout and publish (the module
    docstring); its rollouts' phase and model-call spans use the same tracer.

    Args:
        provider: An OpenTelemetry ``TracerProvider``.

    Raises:
        ImportError: Without the ``opentelemetry-api`` package (the ``[otel]`` extra).
    """

    def __init__(self, provider: Any) -> None:
        self.api = _load()
        self.tracer: Any = provider.get_tracer("rollout_server", VERSION)
        self.spans: dict[Any, Any] = {}
        """The ``rollout`` span of each admitted rollout until its publication."""

    def admission(self, headers: Mapping[str, str]) -> contextlib.AbstractContextManager[Any]:
        """The ``POST /rollout`` span, continuing the trace of ``headers`` (``traceparent``).

        The span is current inside the ``with`` block, whose value is a callable taking the
        answer's status code; an exception leaving the block is recorded as a 500.
        """
        api = self.api
        span = self.tracer.start_span(
            "POST /rollout",
            context=api.propagate.extract(headers),
            kind=api.trace.SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": "/rollout"},
        )
        return _Admission(api, span)

    def rollout_scope(self, record: Any) -> contextlib.AbstractContextManager[None]:
        """Start the ``rollout`` span of ``record`` (a new registry record) and keep it
        current, with this server's tracer, inside the ``with`` block: the execution task
        created there runs in its context."""
        return _RolloutScope(self, record)

    def published(self, record: Any, status: Any, category: Any) -> None:
        """End the ``rollout`` span of ``record`` with its status and category, after a
        ``publish`` span (a registry observer)."""
        span = self.spans.pop(record, None)
        if span is None:
            return
        publish = self.tracer.start_span(
            "publish",
            context=self.api.trace.set_span_in_context(span),
            attributes={ROLLOUT_ID_ATTRIBUTE: record.rollout_id},
        )
        for finished in (publish, span):
            set_outcome(finished, status, category)
            finished.end()

    def delivered(self, record: Any) -> None:
        """Nothing to trace (the span ended at publication); a registry observer."""


# -- which provider -------------------------------------------------------------------------

_ENDPOINT_ENVS: Final = (
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    OSMOSIS_OTLP_ENDPOINT_ENV,
)


def _wants_exporter(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return any(environ.get(name, "").strip() for name in _ENDPOINT_ENVS)


def provider_from_environment(environ: Mapping[str, str] | None = None) -> Any:
    """A new SDK ``TracerProvider`` as the ``OTEL_*`` variables of ``environ`` describe it,
    or None when they ask for no exporter (or the ``[otel]`` extra is missing: then a
    WARNING says what to install).

    Exporters (``OTEL_TRACES_EXPORTER``, default ``otlp``): ``otlp`` sends OTLP/HTTP
    protobuf to ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``, else
    ``OSMOSIS_ROLLOUT_OTLP_ENDPOINT`` + ``/v1/traces``; ``console`` prints spans to
    stdout. The SDK itself reads the rest: ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` (default service name ``rollout-server``),
    ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_*_HEADERS``,
    ``..._TIMEOUT``, ``..._COMPRESSION``, ``..._CERTIFICATE``.

    Args:
        environ: The variables; default :data:`os.environ`.
    """
    env = os.environ if environ is None else environ
    if not _wants_exporter(env):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        logger.warning(
            "The environment asks for OpenTelemetry traces, but %s is not installed (%s); "
            "no traces are exported",
            _INSTALL_HINT,
            exc,
        )
        return None
    exporters: list[Any] = []
    for listed in env.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(","):
        name = listed.strip()
        if name == "otlp":
            exporter = _otlp_exporter(env)
            if exporter is not None:
                exporters.append(exporter)
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name and name != "none":
            logger.warning(
                "OTEL_TRACES_EXPORTER names %r, which rollout-server does not know (use otlp "
                "or console); it is ignored",
                name,
            )
    if not exporters:
        return None
    resource = Resource.create({})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter(env: Mapping[str, str]) -> Any:
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    ) or "http/protobuf"
    if protocol.strip().lower() != "http/protobuf":
        logger.warning(
            "OTLP protocol %r is not supported by rollout-server (it sends http/protobuf, "
            "usually to port 4318); no traces are exported over OTLP",
            protocol,
        )
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        logger.warning(
            "OTLP trace export needs %s (%s); no traces are exported over OTLP", _INSTALL_HINT, exc
        )
        return None
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if not endpoint:
        base = (
            env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
            or env.get(OSMOSIS_OTLP_ENDPOINT_ENV, "").strip()
            or "http://localhost:4318"
        )
        endpoint = f"{base.removesuffix('/')}/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


_configured: list[Any] = []
"""The provider :func:`default_tracer_provider` configured from the environment (at most one
per process)."""


def default_tracer_provider() -> Any:
    """The tracer provider of a server built without one (module docstring), or None.

    A provider configured here from the environment is set as the global provider once,
    so the workflows' own instrumentation exports through it too.
    """
    if _configured:
        return _configured[0]
    try:
        from opentelemetry import trace
    except ImportError:
        if _wants_exporter(os.environ):
            logger.warning(
                "The environment asks for OpenTelemetry traces, but %s is not installed; no "
                "traces are exported",
                _INSTALL_HINT,
            )
        return None
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return current
    provider = provider_from_environment()
    if provider is not None:
        trace.set_tracer_provider(provider)
        _configured.append(provider)
    return provider
