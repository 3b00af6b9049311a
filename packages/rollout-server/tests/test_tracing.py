"""OpenTelemetry spans of a rollout server, recorded with the SDK's in-memory exporter.

One trace joins the caller's admission request, the server's spans for the rollout and
its phases, and the workflow's model calls, whose ``traceparent`` reaches the model
server (a small aiohttp app in the test). Without a provider nothing is traced.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
    get_rollout_context,
)
from rollout_server.observability._jsonlog import JsonFormatter
from rollout_server.observability._tracing import provider_from_environment

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"


def hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.trace_id, "032x")


def hex_span(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.span_id, "016x")


def parent_of(span: ReadableSpan) -> str | None:
    return None if span.parent is None else format(span.parent.span_id, "016x")


class ChatServer:
    """A model server stand-in: answers every chat completion and keeps the
    ``traceparent`` header of each request (None when absent)."""

    def __init__(self) -> None:
        self.traceparents: list[str | None] = []
        self.url = ""

    async def complete(self, request: web.Request) -> web.Response:
        self.traceparents.append(request.headers.get("traceparent"))
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "4"}}]})


@pytest.fixture
async def chat(aiohttp_server: Any) -> ChatServer:
    server = ChatServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.complete)
    running = await aiohttp_server(app, host="127.0.0.1")
    server.url = f"http://127.0.0.1:{running.port}/v1"
    return server


class ModelCallingWorkflow(AgentWorkflow):
    """Two model calls through ``model_call()``, logging a line from inside the workflow."""

    headers_seen: ClassVar[list[dict[str, str]]] = []
    fail: ClassVar[set[str]] = set()

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        rollout = get_rollout_context()
        logging.getLogger("test.workflow").info("calling the model", extra={"rollout_id": "x"})
        messages = list(ctx.prompt)
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                with rollout.model_call("m") as headers:
                    self.headers_seen.append(dict(headers))
                    async with session.post(
                        f"{rollout.chat_completions_url}/chat/completions",
                        json={"model": "m", "messages": messages},
                        headers=headers,
                    ) as response:
                        messages.append((await response.json())["choices"][0]["message"])
        if ctx.rollout_id in self.fail:
            raise RuntimeError("the workflow gave up")
        return AgentWorkflowOutput(messages=messages)


class OneGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(1.0)


@pytest.fixture(autouse=True)
def _reset_workflow() -> None:
    ModelCallingWorkflow.headers_seen.clear()
    ModelCallingWorkflow.fail.clear()


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    traced = TracerProvider(shutdown_on_exit=False)
    traced.add_span_processor(SimpleSpanProcessor(exporter))
    yield traced
    traced.shutdown()


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend(
        ModelCallingWorkflow,
        workflow_config=AgentWorkflowConfig(name="w", concurrency={"max_concurrent": 2}),
        grader=OneGrader,
        artifact_root=tmp_path,
    )


async def run_rollout(harness: Any, rollout_id: str, chat_url: str, **headers: str) -> Any:
    reply = await harness.post_rollout(
        {
            "rollout_id": rollout_id,
            "initial_messages": [{"role": "user", "content": "2+2?"}],
            "chat_completions_url": chat_url,
            "label": "4",
        },
        headers=headers,
    )
    assert reply.status == 202, reply
    token = reply.json["polling_lease_token"]
    return await harness.poll_until(rollout_id, token, "success", "failure", "cancelled")


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


class TestRolloutTrace:
    async def test_one_trace_joins_caller_server_and_model_server(
        self,
        make_harness: Any,
        provider: TracerProvider,
        exporter: InMemorySpanExporter,
        backend: LocalBackend,
        chat: ChatServer,
    ) -> None:
        """The caller's trace continues through admission, the rollout and each phase to
        every model call, whose traceparent reaches the model server; every span carries
        the rollout id, the rollout span its status."""
        harness = await make_harness(backend=backend, tracer_provider=provider)
        reply = await run_rollout(harness, "r1", chat.url, traceparent=CALLER_TRACEPARENT)
        assert reply.json["status"] == "success"
        spans = spans_by_name(exporter)
        assert set(spans) == {
            "POST /rollout",
            "rollout",
            "queue",
            "workflow",
            "chat m",
            "grading",
            "trajectory write",
            "publish",
        }
        assert len(spans["chat m"]) == 2
        every = [span for group in spans.values() for span in group]
        assert {hex_trace(span) for span in every} == {CALLER_TRACE_ID}
        assert all(span.attributes is not None for span in every)
        assert {span.attributes["rollout.id"] for span in every if span.attributes} == {"r1"}

        (admission,) = spans["POST /rollout"]
        (rollout,) = spans["rollout"]
        (workflow,) = spans["workflow"]
        assert admission.kind is SpanKind.SERVER
        assert parent_of(admission) == CALLER_SPAN_ID
        assert admission.attributes is not None
        assert admission.attributes["http.response.status_code"] == 202
        assert parent_of(rollout) == hex_span(admission)
        for name in ("queue", "workflow", "grading", "trajectory write", "publish"):
            assert parent_of(spans[name][0]) == hex_span(rollout), name
        calls = spans["chat m"]
        assert {parent_of(call) for call in calls} == {hex_span(workflow)}
        assert all(call.kind is SpanKind.CLIENT for call in calls)
        assert chat.traceparents == [
            f"00-{CALLER_TRACE_ID}-{hex_span(call)}-01"
            for call in sorted(calls, key=lambda span: span.start_time or 0)
        ]
        assert rollout.attributes is not None
        assert rollout.attributes["rollout.status"] == "success"
        assert "rollout.err_category" not in rollout.attributes
        assert rollout.status.status_code is StatusCode.UNSET

    async def test_a_failed_workflow_marks_its_spans_failed(
        self,
        make_harness: Any,
        provider: TracerProvider,
        exporter: InMemorySpanExporter,
        backend: LocalBackend,
        chat: ChatServer,
    ) -> None:
        """A workflow that raises: its span and the rollout's are failed with the error
        category; without a caller's traceparent the rollout starts a trace of its own."""
        ModelCallingWorkflow.fail.add("r1")
        harness = await make_harness(backend=backend, tracer_provider=provider)
        reply = await run_rollout(harness, "r1", chat.url)
        assert (reply.json["status"], reply.json["err_category"]) == ("failure", "agent_error")
        spans = spans_by_name(exporter)
        assert "grading" not in spans
        for name in ("workflow", "rollout", "publish"):
            (span,) = spans[name]
            assert span.status.status_code is StatusCode.ERROR, name
            assert span.attributes is not None
            assert span.attributes["rollout.err_category"] == "agent_error", name
        (admission,) = spans["POST /rollout"]
        assert admission.parent is None
        assert hex_trace(spans["rollout"][0]) == hex_trace(admission)

    async def test_a_refused_admission_is_a_span_without_a_rollout(
        self,
        make_harness: Any,
        provider: TracerProvider,
        exporter: InMemorySpanExporter,
        body: Any,
    ) -> None:
        """A duplicate admission is traced with its 409 and starts no rollout span."""
        harness = await make_harness(tracer_provider=provider)
        await harness.admit("r1")
        exporter.clear()
        reply = await harness.post_rollout(body("r1"), headers={"traceparent": CALLER_TRACEPARENT})
        assert reply.status == 409
        (admission,) = exporter.get_finished_spans()
        assert admission.name == "POST /rollout"
        assert admission.attributes is not None
        assert admission.attributes["http.response.status_code"] == 409
        assert hex_trace(admission) == CALLER_TRACE_ID

    async def test_an_unsampled_caller_records_nothing_but_still_propagates(
        self,
        make_harness: Any,
        provider: TracerProvider,
        exporter: InMemorySpanExporter,
        backend: LocalBackend,
        chat: ChatServer,
    ) -> None:
        """A caller that does not sample its trace gets no spans recorded (the default
        parent-based sampler), and the model server still sees the caller's trace id."""
        harness = await make_harness(backend=backend, tracer_provider=provider)
        unsampled = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-00"
        reply = await run_rollout(harness, "r1", chat.url, traceparent=unsampled)
        assert reply.json["status"] == "success"
        assert exporter.get_finished_spans() == ()
        assert len(chat.traceparents) == 2
        for traceparent in chat.traceparents:
            assert traceparent is not None
            assert traceparent.startswith(f"00-{CALLER_TRACE_ID}-")
            assert traceparent.endswith("-00")

    async def test_json_log_lines_carry_the_trace_of_the_code_that_logged(
        self,
        make_harness: Any,
        provider: TracerProvider,
        exporter: InMemorySpanExporter,
        backend: LocalBackend,
        chat: ChatServer,
    ) -> None:
        """A line logged inside a traced workflow, formatted as JSON where it is logged,
        names the trace and the workflow's span."""
        lines: list[str] = []

        class Lines(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(self.format(record))

        handler = Lines()
        handler.setFormatter(JsonFormatter())
        workflow_logger = logging.getLogger("test.workflow")
        workflow_logger.addHandler(handler)
        workflow_logger.setLevel(logging.INFO)
        try:
            harness = await make_harness(backend=backend, tracer_provider=provider)
            reply = await run_rollout(harness, "r1", chat.url, traceparent=CALLER_TRACEPARENT)
        finally:
            workflow_logger.removeHandler(handler)
        assert reply.json["status"] == "success"
        (workflow,) = spans_by_name(exporter)["workflow"]
        (line,) = lines
        document = json.loads(line)
        assert document["message"] == "calling the model"
        assert (document["trace_id"], document["span_id"]) == (
            CALLER_TRACE_ID,
            hex_span(workflow),
        )


class TestUntraced:
    async def test_without_a_provider_model_calls_send_no_trace_headers(
        self, make_harness: Any, backend: LocalBackend, chat: ChatServer
    ) -> None:
        """A server that does not trace has no tracing object, and its workflows' model
        calls get empty headers."""
        harness = await make_harness(backend=backend)
        assert harness.server.tracing is None
        reply = await run_rollout(harness, "r1", chat.url, traceparent=CALLER_TRACEPARENT)
        assert reply.json["status"] == "success"
        assert ModelCallingWorkflow.headers_seen == [{}, {}]
        assert chat.traceparents == [None, None]


class TestProviderFromEnvironment:
    def test_nothing_is_configured_without_an_exporter(self) -> None:
        """No endpoint and no exporter named, or tracing turned off: no provider."""
        assert provider_from_environment({}) is None
        assert provider_from_environment({"OTEL_SERVICE_NAME": "x"}) is None
        endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
        assert provider_from_environment({**endpoint, "OTEL_SDK_DISABLED": "true"}) is None
        assert provider_from_environment({**endpoint, "OTEL_TRACES_EXPORTER": "none"}) is None

    def test_an_endpoint_configures_a_named_provider(self) -> None:
        """An OTLP endpoint gives an SDK provider whose service is ``rollout-server``
        unless the environment names one."""
        provider = provider_from_environment(
            {"OSMOSIS_ROLLOUT_OTLP_ENDPOINT": "http://127.0.0.1:9"}
        )
        assert isinstance(provider, TracerProvider)
        try:
            assert provider.resource.attributes["service.name"] == "rollout-server"
        finally:
            provider.shutdown()

    def test_grpc_and_unknown_exporters_are_refused_with_a_warning(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The gRPC protocol and unknown exporter names give no provider and a WARNING
        naming what to use instead."""
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
        with caplog.at_level(logging.WARNING, logger="rollout_server.tracing"):
            assert provider_from_environment({**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is None
            assert provider_from_environment({**env, "OTEL_TRACES_EXPORTER": "zipkin"}) is None
        text = caplog.text
        assert "'grpc' is not supported" in text
        assert "http/protobuf" in text
        assert "'zipkin'" in text

    def test_a_missing_extra_is_named_in_a_warning(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Without the SDK installed, a configured environment gives no provider and a
        WARNING that says which extra to install."""
        monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
        with caplog.at_level(logging.WARNING, logger="rollout_server.tracing"):
            provider = provider_from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1"})
        assert provider is None
        assert "pip install 'rollout-server[otel]'" in caplog.text
