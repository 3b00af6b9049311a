"""Capture golden wire payloads from live osmosis-ai rollout servers and callers.

The reference implementation of the rollout protocol is the ``osmosis-ai`` package.
This tool runs it as a live peer and records what actually crosses the wire, so the
tests of ``rollout-types`` (and the interop tests of the client and server) can
compare our encoders and decoders with real bytes instead of with a reading of the
specification. Nothing of osmosis-ai is imported by the project itself; this script
only *uses* it, from a separate virtual environment.

How to run it (from the repository root)::

    python3.12 -m venv /work/.venv-osmosis
    /work/.venv-osmosis/bin/pip install 'osmosis-ai[server]==0.3.8' uvicorn
    # optional, for the pre-0.3.3 callback protocol:
    python3.12 -m venv /work/.venv-osmosis032
    /work/.venv-osmosis032/bin/pip install 'osmosis-ai[server]==0.3.2' uvicorn

    /work/.venv-osmosis/bin/python tools/capture_golden.py \\
        --legacy-python /work/.venv-osmosis032/bin/python

It takes about 15 seconds. Without ``--legacy-python`` only the 0.3.8 set is
rewritten. The tool must be started with the interpreter of the 0.3.8 venv; it
re-runs itself with ``--legacy-mode`` under the 0.3.2 interpreter for the legacy
set.

What it does:

* Serves osmosis-ai's own ``create_rollout_server(backend=LocalBackend(...))`` with
  uvicorn on ``127.0.0.1`` (ephemeral ports, in-process), wrapped in a small ASGI
  recorder that keeps every request and response byte for byte. The workflow and
  grader classes below choose their behaviour from the request ``metadata``
  (``{"workflow": ..., "grader": ...}``) so one server covers every outcome.
* Drives those servers with osmosis-ai's ``RolloutClient`` (so request bodies are
  exactly what the reference client sends, explicit ``null`` keys included) and
  with raw ``httpx`` requests for the error paths the client never produces.
* The shutdown-time 503 cannot be reached through uvicorn (it closes its sockets
  before the app's lifespan shutdown runs), so that one is captured by running the
  app's lifespan by hand behind ``httpx.ASGITransport``.
* Writes one pretty-printed JSON file per payload (``.txt`` for the one non-JSON
  body) under ``packages/rollout-types/tests/data/golden/osmosis-<version>/`` and an
  ``index.json`` there. The index maps each file name to ``method``, ``path``,
  ``status`` (``null`` for requests), ``headers_of_interest``, ``kind``
  (``"request"`` or ``"response"``), ``source``, ``description``, the
  ``request_body`` that produced a response when the tool wrote that body by hand,
  and ``placeholders`` when random values were replaced.

Determinism: lease tokens, the server's ``process_id``/``instance_id`` UUID and
ephemeral loopback ports are random, so they are replaced by fixed placeholders of
the same shape (``GOLDEN_LEASE_TOKEN``, ``GOLDEN_UUID``, ``GOLDEN_LOOPBACK_BASE``).
Rollout ids are fixed strings chosen here. Running the tool twice gives identical
files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from devprocs import stop_async_process

# Names that exist with the same meaning in osmosis-ai 0.3.2 and 0.3.8. Anything
# version-specific is imported inside the function that needs it.
from osmosis_ai.rollout import (
    AgentWorkflow,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    LocalBackend,
    get_rollout_context,
)
from osmosis_ai.rollout.server import create_rollout_server

SCRIPT_PATH = Path(__file__).resolve()
REPO_ROOT = SCRIPT_PATH.parents[1]
DEFAULT_GOLDEN_ROOT = REPO_ROOT / "packages" / "rollout-types" / "tests" / "data" / "golden"
CURRENT_VERSION = "0.3.8"
LEGACY_VERSION = "0.3.2"

# Placeholders: same shape as the random originals (43-char base64url, UUID4).
GOLDEN_LEASE_TOKEN = "GoldenLeaseToken_0123456789-abcdefghijklmno"  # noqa: S105 (placeholder)
GOLDEN_UUID = "00000000-0000-4000-8000-000000000000"
GOLDEN_LOOPBACK_BASE = "http://127.0.0.1:50000"
assert len(GOLDEN_LEASE_TOKEN) == 43

# Fixed inputs. None of these reach a real LLM: the workflows never dial it.
FAKE_BRIDGE_BASE = "http://127.0.0.1:9/v1/rollouts"
GOLDEN_SERVER_KEY = "golden-server-api-key"  # bearer for the auth-enabled server
GOLDEN_LLM_KEY = "golden-llm-api-key"
GOLDEN_CONTROLLER_KEY = "golden-controller-key"  # 0.3.2 callback bearer
WRONG_LEASE = "not-the-lease-token"
RESULT_WAIT_SEC = 1.0
POLLING_LEASE_SEC = 3.0
RETENTION_SEC = 60.0
LEGACY_CHILD_TIMEOUT_SEC = 90.0

PROMPT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 6 * 7?"},
]
LABEL = "42"

RESPONSE_HEADERS = ("content-type", "retry-after", "allow", "www-authenticate", "location")
REQUEST_HEADERS = ("content-type", "accept", "authorization", "x-osmosis-rollout-lease")

log = logging.getLogger("capture_golden")


def chat_url(rollout_id: str) -> str:
    """The OpenAI-style base URL a caller hands out for one rollout."""
    return f"{FAKE_BRIDGE_BASE}/{rollout_id}"


# --------------------------------------------------------------------------------------
# User code served by the osmosis server
# --------------------------------------------------------------------------------------


class GoldenCrash(BaseException):
    """Escapes ``except Exception`` in the server, so its execution task crashes."""


class GoldenWorkflow(AgentWorkflow):
    """Answers from the prompt; ``metadata["workflow"]`` selects a failure mode.

    Modes: ``echo`` (default), ``sleep`` (``metadata["seconds"]``), ``value_error``,
    ``runtime_error``.
    """

    async def run(self, ctx: AgentWorkflowContext) -> AgentWorkflowOutput:
        metadata = ctx.metadata or {}
        mode = metadata.get("workflow", "echo")
        rollout = get_rollout_context()
        log.debug(
            "workflow ctx: prompt=%r metadata=%r chat_url=%r api_key=%r",
            ctx.prompt,
            ctx.metadata,
            rollout.chat_completions_url if rollout else None,
            rollout.api_key if rollout else None,
        )
        if mode == "sleep":
            await asyncio.sleep(float(metadata.get("seconds", 30)))
        elif mode == "value_error":
            raise ValueError("golden workflow rejected its input")
        elif mode == "runtime_error":
            raise RuntimeError("golden workflow crashed")
        return AgentWorkflowOutput(
            messages=[*ctx.prompt, {"role": "assistant", "content": "6 * 7 = 42"}],
            metrics={"turns": 1.0},
        )


class GoldenGrader(Grader):
    """Sets reward 0.5; ``metadata["grader"]`` selects another behaviour.

    Modes: ``half`` (default), ``remove_sample`` (reward 0.7 and remove_sample),
    ``no_reward``, ``sleep`` (``metadata["seconds"]``, then reward 0.5).
    """

    async def grade(self, ctx: GraderContext) -> None:
        metadata = ctx.metadata or {}
        mode = metadata.get("grader", "half")
        if mode == "no_reward":
            return
        if mode == "sleep":
            await asyncio.sleep(float(metadata.get("seconds", 30)))
        ctx.set_reward(0.7 if mode == "remove_sample" else 0.5)
        if mode == "remove_sample" and ctx.sample is not None:
            ctx.sample.remove_sample = True


def make_backend(*, grader: bool = True, capacity: bool = True) -> Any:
    """A 0.3.8 LocalBackend with two test hooks: a fixed capacity and a crash mode."""
    from osmosis_ai.rollout import ExecutionOutcome, ExecutionRequest

    class GoldenBackend(LocalBackend):
        def has_capacity(self) -> bool:
            return capacity

        async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
            if (request.metadata or {}).get("workflow") == "crash":
                raise GoldenCrash("golden backend crash")
            return await super().execute(request)

    return GoldenBackend(workflow=GoldenWorkflow, grader=GoldenGrader if grader else None)


# --------------------------------------------------------------------------------------
# Recording and serving
# --------------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class Exchange:
    """One HTTP request/response pair as the ASGI app saw it."""

    method: str
    path: str
    request_headers: dict[str, str]
    request_body: bytearray = field(default_factory=bytearray)
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytearray = field(default_factory=bytearray)


def _reject_constant(name: str) -> Any:
    """``parse_constant`` hook: strict JSON has no NaN/Infinity literals."""
    raise ValueError(f"non-standard JSON constant {name}")


def _decode_headers(raw: Any) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}


class Recorder:
    """ASGI middleware that keeps every HTTP exchange passing through it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.exchanges: list[Exchange] = []
        self.changed = asyncio.Condition()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        exchange = Exchange(scope["method"], path, _decode_headers(scope["headers"]))
        self.exchanges.append(exchange)

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                exchange.request_body += message.get("body", b"")
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                exchange.response_headers = _decode_headers(message.get("headers", []))
                async with self.changed:
                    self.changed.notify_all()
            elif message["type"] == "http.response.body":
                exchange.response_body += message.get("body", b"")
            await send(message)

        await self.app(scope, recording_receive, recording_send)

    async def wait_for(self, method: str, path: str, needle: str) -> Exchange:
        """Wait until a ``method path`` request whose body contains ``needle`` is answered."""

        def find() -> Exchange | None:
            for exchange in self.exchanges:
                if (
                    (exchange.method, exchange.path) == (method, path)
                    and exchange.status
                    and needle.encode() in exchange.request_body
                ):
                    return exchange
            return None

        async with self.changed:
            await self.changed.wait_for(lambda: find() is not None)
        found = find()
        assert found is not None
        return found

    def last(self, method: str, path: str) -> Exchange:
        """The most recent completed exchange for ``method path``."""
        for exchange in reversed(self.exchanges):
            if exchange.method == method and exchange.path == path and exchange.status:
                return exchange
        raise LookupError(f"no recorded {method} {path}")


@contextlib.asynccontextmanager
async def serve(app: Any, *, verbose: bool) -> AsyncIterator[tuple[str, Recorder]]:
    """Serve ``app`` (recorded) with uvicorn on 127.0.0.1 until the block exits."""
    recorder = Recorder(app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        recorder,
        lifespan="on",
        log_level="info" if verbose else "critical",
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped during startup")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}", recorder
    finally:
        server.should_exit = True
        await task
        sock.close()


# --------------------------------------------------------------------------------------
# Writing golden files
# --------------------------------------------------------------------------------------


class GoldenWriter:
    """Writes scrubbed payload files and their ``index.json`` into one directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.index: dict[str, dict[str, Any]] = {}
        # real value -> (placeholder, names of the fields it stood for)
        self._replacements: dict[str, tuple[str, tuple[str, ...]]] = {}
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)

    def replace(self, real: str, placeholder: str, kind: str) -> None:
        """Substitute ``placeholder`` for every occurrence of ``real`` from now on."""
        if real and real != placeholder:
            _, kinds = self._replacements.get(real, (placeholder, ()))
            if kind not in kinds:
                kinds = (*kinds, kind)
            self._replacements[real] = (placeholder, kinds)

    def _scrub(self, value: Any, used: dict[str, str]) -> Any:
        if isinstance(value, str):
            for real, (placeholder, kinds) in self._replacements.items():
                if real in value:
                    value = value.replace(real, placeholder)
                    used.update(dict.fromkeys(kinds, placeholder))
            return value
        if isinstance(value, dict):
            return {self._scrub(k, used): self._scrub(v, used) for k, v in value.items()}
        if isinstance(value, list):
            return [self._scrub(v, used) for v in value]
        return value

    def _write(
        self,
        name: str,
        body: Any,
        *,
        kind: str,
        method: str,
        path: str,
        status: int | None,
        headers: dict[str, str],
        interest: tuple[str, ...],
        source: str,
        description: str,
        request_body: Any = None,
    ) -> None:
        if name in self.index:
            raise ValueError(f"{name} written twice")
        used: dict[str, str] = {}
        body = self._scrub(body, used)
        entry: dict[str, Any] = {
            "method": method,
            "path": self._scrub(path, used),
            "status": status,
            "headers_of_interest": self._scrub(
                {h: headers[h] for h in interest if h in headers}, used
            ),
            "kind": kind,
            "source": source,
            "description": description,
        }
        if request_body is not None:
            entry["request_body"] = self._scrub(request_body, used)
        if used:
            entry["placeholders"] = dict(sorted(used.items()))
        if name.endswith(".json"):
            text = json.dumps(body, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
        else:
            text = body  # non-JSON bodies are kept byte for byte, without a final newline
        for real in self._replacements:
            if real in text or real in json.dumps(entry):
                raise AssertionError(f"{name}: a random value escaped scrubbing")
        (self.directory / name).write_text(text, encoding="utf-8")
        self.index[name] = entry
        log.info("wrote %s", name)

    def response(
        self,
        name: str,
        exchange: Exchange,
        *,
        source: str,
        description: str,
        include_request: bool = False,
    ) -> None:
        """Write the response half of ``exchange``."""
        assert exchange.status is not None
        raw = bytes(exchange.response_body)
        body: Any
        if exchange.response_headers.get("content-type", "").startswith("application/json"):
            body = json.loads(raw)
        else:
            body = raw.decode("utf-8")
            name = name.removesuffix(".json") + ".txt"
        request_body: Any = None
        if include_request and exchange.request_body:
            try:
                request_body = json.loads(exchange.request_body, parse_constant=_reject_constant)
            except ValueError:  # not strict JSON: keep the text as sent
                request_body = exchange.request_body.decode("utf-8", errors="replace")
        self._write(
            name,
            body,
            kind="response",
            method=exchange.method,
            path=exchange.path,
            status=exchange.status,
            headers=exchange.response_headers,
            interest=RESPONSE_HEADERS,
            source=source,
            description=description,
            request_body=request_body,
        )

    def request(
        self, name: str, exchange: Exchange, *, source: str, description: str, body: Any = None
    ) -> None:
        """Write the request half of ``exchange`` (its JSON body, or ``body``)."""
        if body is None:
            body = json.loads(exchange.request_body)
        self._write(
            name,
            body,
            kind="request",
            method=exchange.method,
            path=exchange.path,
            status=None,
            headers=exchange.request_headers,
            interest=REQUEST_HEADERS,
            source=source,
            description=description,
        )

    def finish(self) -> None:
        text = json.dumps(
            dict(sorted(self.index.items())), indent=2, ensure_ascii=False, allow_nan=False
        )
        (self.directory / "index.json").write_text(text + "\n", encoding="utf-8")
        log.info("wrote index.json (%d entries) in %s", len(self.index), self.directory)


# --------------------------------------------------------------------------------------
# osmosis-ai 0.3.8
# --------------------------------------------------------------------------------------

CLIENT = "osmosis RolloutClient 0.3.8"
RAW = "raw httpx, body written by this tool"
SERVER = "osmosis-ai 0.3.8 server (create_rollout_server + LocalBackend) on uvicorn"


def init_body(rollout_id: str, **overrides: Any) -> dict[str, Any]:
    """A full admission body in the shape the osmosis client sends."""
    body: dict[str, Any] = {
        "initial_messages": PROMPT,
        "label": LABEL,
        "metadata": None,
        "rollout_id": rollout_id,
        "chat_completions_url": chat_url(rollout_id),
        "llm_api_key": None,
        "grade": True,
        "agent_timeout_sec": None,
        "grader_timeout_sec": None,
        "extra_fields": None,
    }
    body.update(overrides)
    return body


class Driver:
    """Raw-HTTP helpers bound to one recorded server."""

    def __init__(self, http: httpx.AsyncClient, recorder: Recorder, out: GoldenWriter) -> None:
        self.http = http
        self.recorder = recorder
        self.out = out

    async def send(self, method: str, path: str, **kwargs: Any) -> Exchange:
        response = await self.http.request(method, path, **kwargs)
        await response.aread()
        return self.recorder.last(method, path)

    async def admit(self, body: dict[str, Any]) -> str:
        """POST /rollout, expect 202, register the token placeholder, return the token."""
        exchange = await self.send("POST", "/rollout", json=body)
        if exchange.status != 202:
            raise RuntimeError(f"admission failed: {exchange.status} {exchange.response_body!r}")
        token: str = json.loads(exchange.response_body)["polling_lease_token"]
        self.out.replace(token, GOLDEN_LEASE_TOKEN, "polling_lease_token")
        return token

    async def poll(self, rollout_id: str, token: str) -> Exchange:
        return await self.send(
            "GET", f"/rollout/{rollout_id}/result", headers={"X-Osmosis-Rollout-Lease": token}
        )

    async def poll_until_final(self, rollout_id: str, token: str) -> Exchange:
        for _ in range(50):
            exchange = await self.poll(rollout_id, token)
            status = json.loads(exchange.response_body)["status"]
            if status in {"success", "failure", "cancelled"}:
                return exchange
        raise RuntimeError(f"{rollout_id} never finished")

    async def health(self) -> Exchange:
        exchange = await self.send("GET", "/health")
        payload = json.loads(exchange.response_body)
        self.out.replace(payload["process_id"], GOLDEN_UUID, "process_id")
        self.out.replace(payload["instance_id"], GOLDEN_UUID, "instance_id")
        return exchange


TERMINAL_OUTCOMES: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    (
        "result_success_remove_sample.json",
        "golden-remove-sample",
        {"metadata": {"grader": "remove_sample"}},
        "Grader set reward 0.7 and remove_sample=true: success with reward nulled.",
    ),
    (
        "result_success_ungraded.json",
        "golden-ungraded",
        {"grade": False},
        "grade=false: success with the workflow sample and reward null.",
    ),
    (
        "result_failure_validation_error.json",
        "golden-value-error",
        {"metadata": {"workflow": "value_error"}},
        "Workflow raised ValueError: failure/validation_error, no sample.",
    ),
    (
        "result_failure_agent_error.json",
        "golden-agent-error",
        {"metadata": {"workflow": "runtime_error"}},
        "Workflow raised RuntimeError: failure/agent_error, no sample.",
    ),
    (
        "result_failure_timeout.json",
        "golden-timeout",
        {"metadata": {"workflow": "sleep", "seconds": 30}, "agent_timeout_sec": 0.5},
        "agent_timeout_sec=0.5 hit by a sleeping workflow: failure/timeout.",
    ),
    (
        "result_failure_grader_timeout.json",
        "golden-grader-timeout",
        {"metadata": {"grader": "sleep", "seconds": 30}, "grader_timeout_sec": 0.5},
        "grader_timeout_sec=0.5 hit: failure/timeout with the sample, reward null.",
    ),
    (
        "result_failure_no_reward.json",
        "golden-no-reward",
        {"metadata": {"grader": "no_reward"}},
        "Grader returned without a reward: failure/validation_error with sample.",
    ),
    (
        "result_failure_internal_error.json",
        "golden-internal-error",
        {"metadata": {"workflow": "crash"}},
        "Backend raised a BaseException subclass: the task crashed and the server "
        "published failure/internal_error (0.3.6+).",
    ),
)
"""(file, rollout id, run_rollout arguments besides the label, description) of each
terminal outcome the osmosis client reaches on the main server."""

ERROR_CASES: tuple[tuple[str, str, str, dict[str, Any], str], ...] = (
    (
        "error_409.json",
        "POST",
        "/rollout",
        {"json": init_body("golden-minimal")},
        "Re-admitting an id whose result is retained.",
    ),
    (
        "error_403.json",
        "GET",
        "/rollout/golden-minimal/result",
        {"headers": {"X-Osmosis-Rollout-Lease": WRONG_LEASE}},
        "Known id, wrong lease token.",
    ),
    (
        "error_404.json",
        "GET",
        "/rollout/golden-unknown/result",
        {"headers": {"X-Osmosis-Rollout-Lease": WRONG_LEASE}},
        "Unknown rollout id (any token).",
    ),
    (
        "error_404_unknown_route.json",
        "GET",
        "/nothing",
        {},
        "A path no route matches.",
    ),
    (
        "error_405.json",
        "GET",
        "/rollout",
        {},
        "Wrong method on an existing route (FastAPI adds an Allow header).",
    ),
    (
        "error_422_missing_header.json",
        "GET",
        "/rollout/golden-minimal/result",
        {},
        "Poll without the X-Osmosis-Rollout-Lease header.",
    ),
    (
        "error_422_empty_header.json",
        "GET",
        "/rollout/golden-minimal/result",
        {"headers": {"X-Osmosis-Rollout-Lease": ""}},
        "Poll with an empty X-Osmosis-Rollout-Lease header.",
    ),
    (
        "error_422_rollout_id.json",
        "POST",
        "/rollout",
        {"json": init_body("bad/id")},
        "rollout_id with a path separator.",
    ),
    (
        "error_422_rollout_id_type.json",
        "POST",
        "/rollout",
        {"json": {**init_body("golden-number-id"), "rollout_id": 7}},
        "rollout_id sent as a JSON number (not coerced).",
    ),
    (
        "error_422_llm_api_key.json",
        "POST",
        "/rollout",
        {"json": init_body("golden-empty-key", llm_api_key="")},
        "llm_api_key set to the empty string.",
    ),
    (
        "error_422_missing_fields.json",
        "POST",
        "/rollout",
        {"json": {}},
        "Admission body without the three required keys.",
    ),
    (
        "error_422_json_invalid.json",
        "POST",
        "/rollout",
        {
            "content": b'{"rollout_id": ',
            "headers": {"Content-Type": "application/json"},
        },
        "Undecodable JSON body.",
    ),
    (
        "error_422_empty_body.json",
        "POST",
        "/rollout",
        {"content": b"", "headers": {"Content-Type": "application/json"}},
        "An empty request body.",
    ),
    (
        "error_422_text_plain.json",
        "POST",
        "/rollout",
        {
            "content": json.dumps(init_body("golden-text-plain")),
            "headers": {"Content-Type": "text/plain"},
        },
        "A valid JSON object sent as text/plain is not parsed as JSON.",
    ),
    (
        "error_422_body_not_object.json",
        "POST",
        "/rollout",
        {"json": [1, 2, 3]},
        "A JSON body that is not an object.",
    ),
    (
        "error_422_cancel_selector.json",
        "POST",
        "/rollout/cancel",
        {"json": {"ids": ["golden-minimal"], "prefix": None, "all": True}},
        "Two cancel selectors at once: 422 with a string detail.",
    ),
    (
        "error_422_cancel_no_selector.json",
        "POST",
        "/rollout/cancel",
        {"json": {"ids": None, "prefix": None, "all": False}},
        "No cancel selector: 422 with a string detail.",
    ),
    (
        "error_422_cancel_list_type.json",
        "POST",
        "/rollout/cancel",
        {"json": {"ids": "golden-minimal"}},
        "ids of the wrong JSON type.",
    ),
    (
        "error_500_nonfinite_timeout.json",
        "POST",
        "/rollout",
        {
            "content": json.dumps(init_body("golden-nan", agent_timeout_sec=float("nan"))),
            "headers": {"Content-Type": "application/json"},
        },
        "agent_timeout_sec as the non-standard NaN literal: osmosis fails to "
        "encode its own 422 and answers 500 text/plain.",
    ),
)
"""(file, method, path, httpx arguments, description) of each error body the main server
answers to a raw request."""


@dataclass
class CurrentCapture:
    """The four recorded osmosis-ai 0.3.8 servers of one capture and what drives them.

    ``main`` serves a LocalBackend with the golden workflow and grader; ``nograder``
    the same without a grader; ``full`` one whose ``has_capacity()`` is False; ``auth``
    one that requires ``Bearer GOLDEN_SERVER_KEY``.
    """

    out: GoldenWriter
    main: Driver
    client: Any
    auth_client: Any
    auth_http: httpx.AsyncClient
    auth_rec: Recorder
    nograder_client: Any
    nograder_rec: Recorder
    full_http: httpx.AsyncClient
    full_rec: Recorder

    async def via_client(
        self, rollout_client: Any, recorder: Recorder, rollout_id: str, **kwargs: Any
    ) -> tuple[Exchange, Exchange]:
        """Run one rollout with the osmosis client; return (admission, final poll)."""
        kwargs.setdefault("initial_messages", PROMPT)
        kwargs.setdefault("chat_completions_url", chat_url(rollout_id))
        handle = await rollout_client.run_rollout_async(rollout_id=rollout_id, **kwargs)
        admission = recorder.last("POST", "/rollout")
        token = json.loads(admission.response_body)["polling_lease_token"]
        self.out.replace(token, GOLDEN_LEASE_TOKEN, "polling_lease_token")
        result = await handle
        final = recorder.last("GET", f"/rollout/{rollout_id}/result")
        assert json.loads(final.response_body)["status"] == result.status.value
        return admission, final


@contextlib.asynccontextmanager
async def current_servers(out: GoldenWriter, *, verbose: bool) -> AsyncIterator[CurrentCapture]:
    """Serve the four 0.3.8 servers of :class:`CurrentCapture` for the ``with`` block."""
    from osmosis_ai.rollout.client import RolloutClient

    timings = {
        "result_wait_timeout_sec": RESULT_WAIT_SEC,
        "polling_lease_timeout_sec": POLLING_LEASE_SEC,
        "result_retention_sec": RETENTION_SEC,
        "configure_logging": False,
    }
    main_app = create_rollout_server(backend=make_backend(), **timings)
    nograder_app = create_rollout_server(backend=make_backend(grader=False), **timings)
    full_app = create_rollout_server(backend=make_backend(capacity=False), **timings)
    auth_app = create_rollout_server(backend=make_backend(), api_key=GOLDEN_SERVER_KEY, **timings)

    async with (
        serve(main_app, verbose=verbose) as (main_url, main_rec),
        serve(nograder_app, verbose=verbose) as (nograder_url, nograder_rec),
        serve(full_app, verbose=verbose) as (full_url, full_rec),
        serve(auth_app, verbose=verbose) as (auth_url, auth_rec),
        httpx.AsyncClient(base_url=main_url, timeout=15) as main_http,
        httpx.AsyncClient(base_url=full_url, timeout=15) as full_http,
        httpx.AsyncClient(base_url=auth_url, timeout=15) as auth_http,
    ):
        capture = CurrentCapture(
            out=out,
            main=Driver(main_http, main_rec, out),
            client=RolloutClient(url=main_url),
            auth_client=RolloutClient(url=auth_url, api_key=GOLDEN_SERVER_KEY),
            auth_http=auth_http,
            auth_rec=auth_rec,
            nograder_client=RolloutClient(url=nograder_url),
            nograder_rec=nograder_rec,
            full_http=full_http,
            full_rec=full_rec,
        )
        yield capture
        for rollout_client in (capture.client, capture.auth_client, capture.nograder_client):
            await rollout_client.aclose()


async def capture_current(golden_root: Path, legacy_python: str | None, verbose: bool) -> None:
    """Capture the osmosis-ai 0.3.8 set (and, via a child process, the 0.3.2 set).

    The scenarios run in this order on purpose: ``cancel_response_all.json`` lists every id
    the main server holds, and the lease-expiry rollout is admitted before the terminal
    outcomes so that its lease runs out while they are captured.
    """
    out = GoldenWriter(golden_root / f"osmosis-{CURRENT_VERSION}")
    async with current_servers(out, verbose=verbose) as capture:
        await capture_health_idle(capture)
        await capture_minimal_rollout(capture)
        await capture_full_rollout(capture)
        await capture_running_and_cancelled(capture)
        await capture_cancel_by_prefix(capture)
        await capture_cancel_all(capture)
        lease_expiry = asyncio.create_task(poll_after_lease_expiry(capture))
        await asyncio.sleep(0.2)  # let it admit before the next ids are registered
        await capture_terminal_outcomes(capture)
        await capture_error_bodies(capture)
        await capture_auth_refusals(capture)
        await capture_capacity_refusal(capture)
        await capture_shutdown_503(out)
        out.response(
            "result_lease_expired.json",
            await lease_expiry,
            source=SERVER,
            description=f"No poll for polling_lease_timeout_sec={POLLING_LEASE_SEC}: "
            "failure/lease_expired, then a late poll.",
        )
        if legacy_python:
            await run_legacy_child(legacy_python, golden_root, verbose)
            await capture_callback_protocol_admission(capture, golden_root)
        await check_duplicate_refused(capture)
    out.finish()


async def capture_health_idle(capture: CurrentCapture) -> None:
    """``health.json``: an idle server."""
    capture.out.response(
        "health.json",
        await capture.main.health(),
        source=RAW,
        description="GET /health on an idle LocalBackend server (default max_concurrent 4).",
    )


async def capture_minimal_rollout(capture: CurrentCapture) -> None:
    """The admission body of the osmosis client with every default, and what follows it."""
    out = capture.out
    admission, final = await capture.via_client(
        capture.client, capture.main.recorder, "golden-minimal"
    )
    out.request(
        "init_request_minimal.json",
        admission,
        source=CLIENT,
        description="client.run_rollout(initial_messages, chat_completions_url, "
        "rollout_id) with every optional argument left at its default.",
    )
    out.response(
        "init_response.json",
        admission,
        source=SERVER,
        description="202 admission response (server built with "
        f"result_wait_timeout_sec={RESULT_WAIT_SEC}, "
        f"polling_lease_timeout_sec={POLLING_LEASE_SEC}).",
    )
    poll_headers = {
        h: final.request_headers[h] for h in REQUEST_HEADERS if h in final.request_headers
    }
    out.request(
        "result_poll_request_headers.json",
        final,
        body={"method": final.method, "path": final.path, "headers": poll_headers},
        source=CLIENT,
        description="The long-poll GET carries no body; this file lists the headers "
        "the osmosis client sends on it.",
    )
    out.response(
        "result_failure_no_label_no_metadata.json",
        final,
        source=SERVER,
        description="Grader configured but label and metadata both null: the grading "
        "gate fails and the wire result is an all-null failure.",
    )


async def capture_full_rollout(capture: CurrentCapture) -> None:
    """The admission body with every optional argument set, and its successful result."""
    admission, final = await capture.via_client(
        capture.auth_client,
        capture.auth_rec,
        "golden-full",
        label=LABEL,
        metadata={"topic": "arithmetic", "difficulty": 1},
        llm_api_key=GOLDEN_LLM_KEY,
        grade=True,
        agent_timeout_sec=30.0,
        grader_timeout_sec=15.0,
        extra_fields={"row_index": 3, "run_index": 0},
    )
    capture.out.request(
        "init_request_full.json",
        admission,
        source=f"{CLIENT} (built with api_key, sent to an auth-enabled server)",
        description="client.run_rollout with label, metadata, llm_api_key, both "
        "timeouts, grade=True and extra_fields set.",
    )
    capture.out.response(
        "result_success.json",
        final,
        source=SERVER,
        description="Final poll of golden-full: workflow returned messages and "
        "metrics, grader set reward 0.5.",
    )


async def capture_running_and_cancelled(capture: CurrentCapture) -> None:
    """A running rollout's poll, busy health, the client's cancel, and the cancelled result."""
    out, main = capture.out, capture.main
    token = await main.admit(
        init_body("golden-running", metadata={"workflow": "sleep", "seconds": 30})
    )
    out.response(
        "result_running.json",
        await main.poll("golden-running", token),
        source=SERVER,
        description="Poll of a sleeping workflow; returns after at most "
        "result_wait_timeout_sec with status running and everything else null.",
    )
    out.response(
        "health_busy.json",
        await main.health(),
        source=RAW,
        description="GET /health while exactly one rollout is executing.",
    )
    await capture.client.cancel_rollout("golden-running")
    cancel = main.recorder.last("POST", "/rollout/cancel")
    out.request(
        "cancel_request_ids.json",
        cancel,
        source=CLIENT,
        description="client.cancel_rollout(rollout_id): the ids selector with "
        "explicit null/false for the other selectors.",
    )
    out.response(
        "cancel_response.json",
        cancel,
        source=SERVER,
        description="Dispositions after cancelling one running rollout.",
    )
    out.response(
        "result_cancelled.json",
        await main.poll_until_final("golden-running", token),
        source=SERVER,
        description="Final poll after cancelling a running rollout (LocalBackend: "
        "the server cancels its own task).",
    )
    out.response(
        "cancel_response_not_found.json",
        await main.send("POST", "/rollout/cancel", json={"ids": ["golden-running"]}),
        source=SERVER,
        description="Repeating the cancel after the result was published.",
        include_request=True,
    )


async def capture_cancel_by_prefix(capture: CurrentCapture) -> None:
    """A prefix cancel over one finished and one running rollout."""
    out, main = capture.out, capture.main
    done_token = await main.admit(init_body("golden-cancel-done"))
    await main.poll_until_final("golden-cancel-done", done_token)
    sleep_token = await main.admit(
        init_body("golden-cancel-sleep", metadata={"workflow": "sleep", "seconds": 30})
    )
    await main.poll("golden-cancel-sleep", sleep_token)  # wait until it is running
    exchange = await main.send("POST", "/rollout/cancel", json={"prefix": "golden-cancel-"})
    out.request(
        "cancel_request_prefix.json",
        exchange,
        source="hand-written (keys omitted on purpose); accepted with 200",
        description="Prefix selector with the other selectors omitted.",
    )
    out.response(
        "cancel_response_prefix.json",
        exchange,
        source=SERVER,
        description="Prefix cancel over one finished (not_found) and one running "
        "(cancelled_running) rollout.",
    )
    await main.poll_until_final("golden-cancel-sleep", sleep_token)


async def capture_cancel_all(capture: CurrentCapture) -> None:
    """``all=true``: every id the server holds, in registration order."""
    out, main = capture.out, capture.main
    all_token = await main.admit(
        init_body("golden-cancel-all", metadata={"workflow": "sleep", "seconds": 30})
    )
    await main.poll("golden-cancel-all", all_token)
    exchange = await main.send("POST", "/rollout/cancel", json={"all": True})
    out.request(
        "cancel_request_all.json",
        exchange,
        source="hand-written (keys omitted on purpose); accepted with 200",
        description="All selector with the other selectors omitted.",
    )
    out.response(
        "cancel_response_all.json",
        exchange,
        source=SERVER,
        description="all=true lists every id the server holds, finished ones as "
        "not_found, in registration order.",
    )
    await main.poll_until_final("golden-cancel-all", all_token)


async def poll_after_lease_expiry(capture: CurrentCapture) -> Exchange:
    """Admit a sleeping rollout, never poll it until its lease expired, then poll once."""
    main = capture.main
    lease_token = await main.admit(
        init_body("golden-lease-expired", metadata={"workflow": "sleep", "seconds": 30})
    )
    await asyncio.sleep(POLLING_LEASE_SEC + 0.5)
    return await main.poll("golden-lease-expired", lease_token)


async def capture_terminal_outcomes(capture: CurrentCapture) -> None:
    """Each of :data:`TERMINAL_OUTCOMES` through the osmosis client, then a grader-less one."""
    for name, rollout_id, arguments, description in TERMINAL_OUTCOMES:
        _, final = await capture.via_client(
            capture.client, capture.main.recorder, rollout_id, **{"label": LABEL, **arguments}
        )
        capture.out.response(name, final, source=SERVER, description=description)
    _, final = await capture.via_client(
        capture.nograder_client, capture.nograder_rec, "golden-no-grader", label=LABEL
    )
    capture.out.response(
        "result_failure_no_grader.json",
        final,
        source=f"{SERVER}, LocalBackend without a grader",
        description="No grader configured, grade=true: all-null failure.",
    )


async def capture_error_bodies(capture: CurrentCapture) -> None:
    """Each of :data:`ERROR_CASES`, sent raw to the main server."""
    for name, method, path, arguments, description in ERROR_CASES:
        exchange = await capture.main.send(method, path, **arguments)
        capture.out.response(
            name, exchange, source=RAW, description=description, include_request=True
        )


async def capture_auth_refusals(capture: CurrentCapture) -> None:
    """401 without a key, and 401 (not 404) on an unknown path with a lower-case scheme."""
    await capture.auth_http.post("/rollout", json=init_body("golden-unauthorized"))
    capture.out.response(
        "error_401.json",
        capture.auth_rec.last("POST", "/rollout"),
        source=f"{RAW}; server built with api_key",
        description="No Authorization header on an auth-enabled server.",
        include_request=True,
    )
    await capture.auth_http.get(
        "/nothing", headers={"Authorization": f"bearer {GOLDEN_SERVER_KEY}"}
    )
    capture.out.response(
        "error_401_unknown_route.json",
        capture.auth_rec.last("GET", "/nothing"),
        source=f"{RAW}; server built with api_key",
        description="Lower-case 'bearer' scheme on an unknown path: auth runs before "
        "routing, so 401 rather than 404.",
    )


async def capture_capacity_refusal(capture: CurrentCapture) -> None:
    """429 with Retry-After from a backend without capacity."""
    await capture.full_http.post("/rollout", json=init_body("golden-full-queue"))
    capture.out.response(
        "error_429.json",
        capture.full_rec.last("POST", "/rollout"),
        source=f"{RAW}; backend.has_capacity() returns False",
        description="Capacity refusal with Retry-After.",
        include_request=True,
    )


async def capture_callback_protocol_admission(capture: CurrentCapture, golden_root: Path) -> None:
    """The 0.3.2 caller's body (captured by the legacy run) admitted by the 0.3.8 server."""
    out, main = capture.out, capture.main
    legacy_dir = golden_root / f"osmosis-{LEGACY_VERSION}"
    legacy_body = json.loads(
        (legacy_dir / "init_request_callback_protocol.json").read_text("utf-8")
    )
    exchange = await main.send("POST", "/rollout", json=legacy_body)
    token = json.loads(exchange.response_body)["polling_lease_token"]
    out.replace(token, GOLDEN_LEASE_TOKEN, "polling_lease_token")
    out.response(
        "init_response_to_callback_protocol_request.json",
        exchange,
        source=SERVER,
        description="The 0.3.2 HttpRolloutDriver body (from "
        f"osmosis-{LEGACY_VERSION}/init_request_callback_protocol.json) is admitted: "
        "the callback keys are ignored, and no callback will ever be sent.",
    )
    await main.poll_until_final(legacy_body["rollout_id"], token)


async def check_duplicate_refused(capture: CurrentCapture) -> None:
    """Confirm the 0.3.8 client turns a 409 into ``RolloutProtocolError(409)`` (no file).

    The osmosis client against a 0.3.2-style refusal is covered by the legacy set.
    """
    from osmosis_ai.rollout.client import RolloutProtocolError

    refused: RolloutProtocolError | None = None
    try:
        await capture.client.run_rollout_async(
            initial_messages=PROMPT,
            chat_completions_url=chat_url("golden-minimal"),
            rollout_id="golden-minimal",
        )
    except RolloutProtocolError as exc:
        refused = exc
    if refused is None or refused.status_code != 409:
        raise AssertionError(f"duplicate admission was not refused with 409: {refused!r}")


async def capture_shutdown_503(out: GoldenWriter) -> None:
    """Reach the shutdown-time 503 by running the app's lifespan by hand.

    uvicorn stops listening before lifespan shutdown, so over a socket a caller sees
    connection errors instead. The ASGI transport keeps the app reachable while its
    lifespan drains one in-flight rollout.
    """
    app = create_rollout_server(
        backend=make_backend(),
        result_wait_timeout_sec=RESULT_WAIT_SEC,
        polling_lease_timeout_sec=POLLING_LEASE_SEC,
        configure_logging=False,
    )
    recorder = Recorder(app)
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    transport = httpx.ASGITransport(app=recorder)
    async with httpx.AsyncClient(transport=transport, base_url="http://asgi.invalid") as http:
        slow = init_body("golden-draining", metadata={"workflow": "sleep", "seconds": 0.8})
        admitted = await http.post("/rollout", json=slow)
        token = admitted.json()["polling_lease_token"]
        out.replace(token, GOLDEN_LEASE_TOKEN, "polling_lease_token")
        shutdown = asyncio.create_task(lifespan.__aexit__(None, None, None))
        await asyncio.sleep(0.1)
        await http.post("/rollout", json=init_body("golden-after-shutdown"))
        out.response(
            "error_503.json",
            recorder.last("POST", "/rollout"),
            source=f"{SERVER}, driven through httpx.ASGITransport during lifespan shutdown",
            description="Admission after shutdown began (no Retry-After).",
            include_request=True,
        )
        health = await http.get("/health")
        payload = health.json()
        out.replace(payload["process_id"], GOLDEN_UUID, "process_id")
        out.response(
            "health_shutting_down.json",
            recorder.last("GET", "/health"),
            source=f"{SERVER}, driven through httpx.ASGITransport during lifespan shutdown",
            description="GET /health while the lifespan drains one in-flight rollout.",
        )
        await shutdown


async def run_legacy_child(python: str, golden_root: Path, verbose: bool) -> None:
    """Re-run this file under the osmosis-ai 0.3.2 interpreter, and wait for it."""
    argv = [python, str(SCRIPT_PATH), "--legacy-mode", "--out", str(golden_root)]
    if verbose:
        argv.append("--verbose")
    process = await asyncio.create_subprocess_exec(*argv)
    code, killed = await stop_async_process(process, patience_sec=LEGACY_CHILD_TIMEOUT_SEC)
    if killed:
        raise TimeoutError(
            f"legacy capture (pid {process.pid}) did not finish within "
            f"{LEGACY_CHILD_TIMEOUT_SEC:g} s and was killed"
        )
    if code != 0:
        raise RuntimeError(f"legacy capture (pid {process.pid}) exited with {code}")


# --------------------------------------------------------------------------------------
# osmosis-ai 0.3.2 (pre-0.3.3 HTTP + callback protocol)
# --------------------------------------------------------------------------------------

LEGACY_CALLER = "osmosis HttpRolloutDriver 0.3.2"
LEGACY_SERVER = "osmosis-ai 0.3.2 server (create_rollout_server + LocalBackend) on uvicorn"


@dataclass
class LegacyCapture:
    """The recorded osmosis-ai 0.3.2 server, its caller's callback app, and the caller."""

    out: GoldenWriter
    http: httpx.AsyncClient
    server_rec: Recorder
    callback_rec: Recorder
    driver: Any


async def capture_legacy(golden_root: Path, verbose: bool) -> None:
    """Capture the 0.3.2 caller's admission and callbacks, and its server's answers."""
    from osmosis_ai.rollout.controller.listener import create_callback_app
    from osmosis_ai.rollout.controller.store import CallbackStore
    from osmosis_ai.rollout.http_driver import HttpRolloutDriver
    from osmosis_ai.rollout.utils.http import close_shared_client

    out = GoldenWriter(golden_root / f"osmosis-{LEGACY_VERSION}")

    async def commit(_result: Any) -> None:
        return None

    store = CallbackStore(on_terminal_commit=commit)
    server_app = create_rollout_server(
        backend=LocalBackend(workflow=GoldenWorkflow, grader=GoldenGrader),
        configure_logging=False,
    )
    callback_app = create_callback_app(store, auth_token=GOLDEN_CONTROLLER_KEY)
    async with (
        serve(server_app, verbose=verbose) as (server_url, server_rec),
        serve(callback_app, verbose=verbose) as (callback_url, callback_rec),
        httpx.AsyncClient(base_url=server_url, timeout=15) as http,
    ):
        out.replace(callback_url, GOLDEN_LOOPBACK_BASE, "callback_listener_base_url")
        capture = LegacyCapture(
            out=out,
            http=http,
            server_rec=server_rec,
            callback_rec=callback_rec,
            driver=HttpRolloutDriver(
                rollout_base_url=server_url,
                callback_store=store,
                completion_url_for=lambda rid: f"{callback_url}/v1/rollouts/{rid}/completion",
                grader_url_for=lambda rid: f"{callback_url}/v1/rollouts/{rid}/grader",
                chat_completions_url_for=chat_url,
                chat_api_key=GOLDEN_LLM_KEY,
                controller_api_key=GOLDEN_CONTROLLER_KEY,
                callback_timeout_sec=30,
            ),
        )
        await capture_legacy_health(capture)
        await capture_callback_rollout(capture)
        await capture_legacy_status(capture)
        await capture_legacy_cancel(capture)
        await capture_pull_protocol_refusal(capture, golden_root)
        await capture.driver.aclose()
        await asyncio.sleep(0.8)  # let the cancelled-but-running workflow finish
        await close_shared_client()
    out.finish()


async def capture_legacy_health(capture: LegacyCapture) -> None:
    """``health.json`` of an idle 0.3.2 server."""
    await capture.http.get("/health")
    capture.out.response(
        "health.json",
        capture.server_rec.last("GET", "/health"),
        source=LEGACY_SERVER,
        description="0.3.2 /health on an idle server without _OSMOSIS_ROLLOUT_INSTANCE_ID.",
    )


async def capture_callback_rollout(capture: LegacyCapture) -> None:
    """One rollout of the callback protocol: the admission and both callbacks."""
    from osmosis_ai.rollout.driver import RolloutRunRequest

    out = capture.out
    outcome = await capture.driver.run(
        RolloutRunRequest(
            messages=PROMPT,
            label=LABEL,
            metadata={"topic": "arithmetic", "difficulty": 1},
            rollout_id="golden-legacy",
            agent_timeout_sec=30.0,
            grader_timeout_sec=15.0,
            extra_fields={"row_index": 3, "run_index": 0},
        )
    )
    assert outcome.sample is not None, outcome
    assert outcome.sample.reward == 0.5, outcome
    admission = capture.server_rec.last("POST", "/rollout")
    out.request(
        "init_request_callback_protocol.json",
        admission,
        source=LEGACY_CALLER,
        description="HttpRolloutDriver.run(RolloutRunRequest(...)) with label, "
        "metadata, timeouts and extra_fields; callback URLs point at a 0.3.2 "
        "CallbackListener app.",
    )
    out.response(
        "init_response_callback_protocol.json",
        admission,
        source=LEGACY_SERVER,
        description="0.3.2 admission: 202 with an empty object.",
    )
    for kind in ("completion", "grader"):
        exchange = capture.callback_rec.last("POST", f"/v1/rollouts/golden-legacy/{kind}")
        out.request(
            f"callback_{kind}_request.json",
            exchange,
            source=LEGACY_SERVER,
            description=f"The {kind} callback the 0.3.2 server pushes to the caller.",
        )
        out.response(
            f"callback_{kind}_response.json",
            exchange,
            source="osmosis-ai 0.3.2 create_callback_app",
            description=f"The caller's acknowledgment of the {kind} callback.",
        )


async def capture_legacy_status(capture: LegacyCapture) -> None:
    """``GET /rollout/{id}/status`` of the finished callback rollout."""
    await capture.http.get("/rollout/golden-legacy/status")
    capture.out.response(
        "status_response.json",
        capture.server_rec.last("GET", "/rollout/golden-legacy/status"),
        source=LEGACY_SERVER,
        description="GET /rollout/{id}/status; LocalBackend keeps no status, so unknown.",
    )


async def capture_legacy_cancel(capture: LegacyCapture) -> None:
    """The cancel request a cancelled ``driver.run`` sends itself, and the answer."""
    from osmosis_ai.rollout.driver import RolloutRunRequest

    slow = RolloutRunRequest(
        messages=PROMPT,
        label=LABEL,
        metadata={"workflow": "sleep", "seconds": 0.5},
        rollout_id="golden-legacy-cancel",
    )
    run = asyncio.create_task(capture.driver.run(slow))
    await capture.server_rec.wait_for("POST", "/rollout", "golden-legacy-cancel")
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    cancel = capture.server_rec.last("POST", "/rollout/cancel")
    capture.out.request(
        "cancel_request_ids.json",
        cancel,
        source=LEGACY_CALLER,
        description="Cancel sent when a driver.run task is cancelled.",
    )
    capture.out.response(
        "cancel_response.json",
        cancel,
        source=LEGACY_SERVER,
        description="0.3.2 LocalBackend does not implement cancel: empty dispositions "
        "(the workflow keeps running).",
    )


async def capture_pull_protocol_refusal(capture: LegacyCapture, golden_root: Path) -> None:
    """The 0.3.8 client's admission body (from the 0.3.8 set) refused by the 0.3.2 server."""
    pull_body = json.loads(
        (golden_root / f"osmosis-{CURRENT_VERSION}" / "init_request_full.json").read_text("utf-8")
    )
    await capture.http.post("/rollout", json=pull_body)
    capture.out.response(
        "error_422_pull_protocol_request.json",
        capture.server_rec.last("POST", "/rollout"),
        source=LEGACY_SERVER,
        description="The 0.3.8 client's body (osmosis-0.3.8/init_request_full.json) "
        "is refused: completion_callback_url is required.",
    )


# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_GOLDEN_ROOT, help="golden root directory"
    )
    parser.add_argument(
        "--legacy-python",
        help="python of a venv with osmosis-ai[server]==0.3.2 (enables the legacy set)",
    )
    parser.add_argument("--legacy-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # osmosis logs every workflow exception with a traceback; keep the run readable.
    logging.getLogger("osmosis_ai").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
    logging.getLogger("httpx").setLevel(logging.INFO if args.verbose else logging.WARNING)
    if args.verbose:
        log.setLevel(logging.DEBUG)

    expected = LEGACY_VERSION if args.legacy_mode else CURRENT_VERSION
    installed = version("osmosis-ai")
    if installed != expected:
        parser.error(f"needs osmosis-ai=={expected} in this interpreter, found {installed}")

    with tempfile.TemporaryDirectory(prefix="golden-artifacts-") as artifacts:
        # LocalBackend writes artifacts and trajectories; keep them out of ~/.osmosis.
        os.environ["_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"] = artifacts
        os.environ.pop("_OSMOSIS_ROLLOUT_INSTANCE_ID", None)
        if args.legacy_mode:
            asyncio.run(capture_legacy(args.out, args.verbose))
        else:
            asyncio.run(capture_current(args.out, args.legacy_python, args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
