"""Traces exported over OTLP/HTTP to a small receiver in the test process.

In process: a provider configured from ``OSMOSIS_ROLLOUT_OTLP_ENDPOINT`` sends its spans
to ``<endpoint>/v1/traces``. End to end: ``rollout-server serve`` configured only by
``OTEL_EXPORTER_OTLP_ENDPOINT`` (and ``--log-format json``) exports the spans of a
rollout admitted with a ``traceparent``, and its workflow's model call carries that trace
to the model server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from rollout_server.observability._tracing import provider_from_environment
from rollout_types import LEASE_HEADER

COMMAND_LOOP_ONLY = True
"""Run these tests once, on uvloop (see conftest): the server under test has its own loop."""

EVENT_SEC = 20.0
START_SEC = 60.0
LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")

NO_PROXY = "127.0.0.1,localhost"
"""Set for the exporter, whose HTTP client would send 127.0.0.1 through a configured proxy."""

CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"


class Receiver:
    """An OTLP/HTTP trace receiver: decodes each protobuf export into its spans."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.services: set[str] = set()
        self.url = ""
        self.arrived = asyncio.Event()

    async def traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.read())
        for resource_spans in export.resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    self.services.add(attribute.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        self.arrived.set()
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def names(self) -> set[str]:
        return {span.name for span in self.spans}

    async def until(self, *names: str) -> None:
        """Wait (bounded) until spans of every name in ``names`` have arrived."""
        async with asyncio.timeout(EVENT_SEC):
            while not set(names) <= self.names():
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def receiver(aiohttp_server: Any) -> Receiver:
    collector = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", collector.traces)
    running = await aiohttp_server(app, host="127.0.0.1")
    collector.url = f"http://127.0.0.1:{running.port}"
    return collector


class TestOsmosisEndpoint:
    async def test_spans_reach_the_endpoint_osmosis_servers_read(
        self, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``OSMOSIS_ROLLOUT_OTLP_ENDPOINT`` alone makes the spans go to
        ``<endpoint>/v1/traces`` as OTLP/HTTP protobuf, from service ``rollout-server``."""
        monkeypatch.setenv("NO_PROXY", NO_PROXY)  # the exporter's HTTP client reads proxies
        provider = provider_from_environment({"OSMOSIS_ROLLOUT_OTLP_ENDPOINT": receiver.url + "/"})
        assert provider is not None
        try:
            with provider.get_tracer("test").start_as_current_span("probe"):
                pass
            # The export runs in the SDK's worker thread; the receiver needs this loop.
            assert await asyncio.to_thread(provider.force_flush, 10_000)
            await receiver.until("probe")
        finally:
            await asyncio.to_thread(provider.shutdown)
        assert receiver.services == {"rollout-server"}


TARGET_MODULE = '''
"""A rollout project for the OTLP test: one model call per rollout, then a grade."""

import aiohttp

from rollout_server import AgentWorkflow, AgentWorkflowOutput, Grader, LocalBackend
from rollout_server import get_rollout_context


class OneCall(AgentWorkflow):
    async def run(self, ctx):
        rollout = get_rollout_context()
        async with aiohttp.ClientSession() as session:
            with rollout.model_call("m") as headers:
                async with session.post(
                    rollout.chat_completions_url + "/chat/completions",
                    json={"model": "m", "messages": ctx.prompt},
                    headers=headers,
                ) as response:
                    reply = (await response.json())["choices"][0]["message"]
        return AgentWorkflowOutput(messages=[*ctx.prompt, reply])


class Exact(Grader):
    async def grade(self, ctx):
        ctx.set_reward(1.0)


def backend():
    return LocalBackend(OneCall, grader=Exact)
'''


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "otlp_target.py").write_text(textwrap.dedent(TARGET_MODULE))
    return tmp_path


@contextlib.contextmanager
def serving(app_dir: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """``rollout-server serve otlp_target:backend --log-format json --log-level DEBUG``
    (a success's "finished" line is at DEBUG), stopped by its PID."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_server",
            "serve",
            "otlp_target:backend",
            "--port",
            "0",
            "--log-format",
            "json",
            "--log-level",
            "DEBUG",
            "--app-dir",
            str(app_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=EVENT_SEC)
        if process.stdout is not None:
            process.stdout.close()


async def read_until(process: subprocess.Popen[bytes], pattern: re.Pattern[bytes]) -> int:
    """Read the server's output until ``pattern`` matches a line; return group 1."""
    stream = process.stdout
    assert stream is not None
    async with asyncio.timeout(START_SEC):
        while True:
            line = await asyncio.to_thread(stream.readline)
            if not line:
                pytest.fail("the server exited before it was listening")
            if match := pattern.search(line):
                return int(match.group(1))


class TestServeExportsOverOtlp:
    async def test_one_trace_from_caller_to_model_server_over_otlp(
        self, receiver: Receiver, aiohttp_server: Any, app_dir: Path
    ) -> None:
        """The served rollout's spans arrive at the collector in the caller's trace, the
        model server receives the model-call span's traceparent, and the log lines are
        JSON with the rollout's id and status."""
        traceparents: list[str | None] = []

        async def complete(request: web.Request) -> web.Response:
            traceparents.append(request.headers.get("traceparent"))
            return web.json_response(
                {"choices": [{"message": {"role": "assistant", "content": "4"}}]}
            )

        chat_app = web.Application()
        chat_app.router.add_post("/v1/chat/completions", complete)
        chat = await aiohttp_server(chat_app, host="127.0.0.1")
        env = {
            "NO_PROXY": NO_PROXY,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "rollouts-under-test",
        }
        with serving(app_dir, env) as process:
            port = await read_until(process, LISTENING)
            base = f"http://127.0.0.1:{port}"
            body = {
                "rollout_id": "r1",
                "initial_messages": [{"role": "user", "content": "2+2?"}],
                "chat_completions_url": f"http://127.0.0.1:{chat.port}/v1",
                "label": "4",
            }
            caller = {"traceparent": f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"}
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{base}/rollout", json=body, headers=caller) as reply:
                    assert reply.status == 202
                    token = (await reply.json())["polling_lease_token"]
                async with asyncio.timeout(EVENT_SEC):
                    while True:
                        async with session.get(
                            f"{base}/rollout/r1/result", headers={LEASE_HEADER: token}
                        ) as reply:
                            result = await reply.json()
                        if result["status"] not in ("queued", "running", "grading"):
                            break
            assert result["status"] == "success", result
            await receiver.until("POST /rollout", "rollout", "workflow", "chat m", "publish")
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(EVENT_SEC):
                code = await asyncio.to_thread(process.wait)
            assert process.stdout is not None
            output = await asyncio.to_thread(process.stdout.read)
        assert code == 0
        assert receiver.services == {"rollouts-under-test"}
        assert {span.trace_id.hex() for span in receiver.spans} == {CALLER_TRACE_ID}
        (admission,) = [span for span in receiver.spans if span.name == "POST /rollout"]
        assert admission.parent_span_id.hex() == CALLER_SPAN_ID
        (call,) = [span for span in receiver.spans if span.name == "chat m"]
        assert traceparents == [f"00-{CALLER_TRACE_ID}-{call.span_id.hex()}-01"]
        documents = [json.loads(line) for line in output.splitlines() if line.strip()]
        finished = [doc for doc in documents if doc["message"].startswith("Rollout r1 finished")]
        assert len(finished) == 1
        assert finished[0]["rollout_id"] == "r1"
        assert finished[0]["status"] == "success"
        assert finished[0]["level"] == "DEBUG"
        assert finished[0]["logger"] == "rollout_server.registry"
        assert {"timestamp", "level", "logger", "message"} <= set(documents[0])
