"""The example rollout project (calculator agent, grader) and the chat stand-in, through a
real rollout server and client."""

from __future__ import annotations

import importlib.util
import io
import json
import socket
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rollout_client import RolloutClient
from rollout_client.eval import EvalOptions, run_eval
from rollout_server import AgentWorkflowConfig, GraderContext, LocalBackend, Sample

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

from calculator_agent import AnswerGrader, CalculatorAgent  # noqa: E402
from calculator_agent.backend import create_backend  # noqa: E402
from calculator_agent.calculator import CalculatorError, calculate  # noqa: E402


def load_standin() -> ModuleType:
    """Import tools/chat_standin/server.py as a module."""
    path = ROOT / "tools" / "chat_standin" / "server.py"
    spec = importlib.util.spec_from_file_location("chat_standin_server", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chat_standin_server"] = module
    spec.loader.exec_module(module)
    return module


def backend(tmp_path: Path, **extra: Any) -> LocalBackend:
    return LocalBackend(
        workflow=CalculatorAgent,
        workflow_config=AgentWorkflowConfig(name="calc", extra=extra),
        grader=AnswerGrader,
        artifact_root=tmp_path / "artifacts",
    )


async def run_one(server_url: str, chat_url: str, question: str, label: str) -> Any:
    async with RolloutClient(url=server_url, admission_timeout_sec=30) as client:
        return await client.run_rollout(
            initial_messages=[{"role": "user", "content": question}],
            chat_completions_url=chat_url,
            rollout_id=uuid.uuid4().hex,
            label=label,
            agent_timeout_sec=30,
            grader_timeout_sec=10,
        )


class TestCalculator:
    def test_exact_arithmetic(self) -> None:
        """Expressions evaluate exactly, with integer powers and floor division."""
        assert calculate("(17 + 4) * 3") == 63
        assert str(calculate("1 / 3 + 1 / 6")) == "1/2"
        assert calculate("2 ** 10 // 3 % 7") == 341 % 7

    @pytest.mark.parametrize(
        ("expression", "message"),
        [
            ("__import__('os')", "only numbers"),
            ("x + 1", "only numbers"),
            ("1 / 0", "division by zero"),
            ("2 ** 1000", "exponents must be integers within"),
            ("1 +", "not an arithmetic expression"),
            ("1" * 600, "longer than"),
        ],
    )
    def test_refuses_anything_else(self, expression: str, message: str) -> None:
        """Names, calls, huge powers, bad syntax and division by zero are refused clearly."""
        with pytest.raises(CalculatorError, match=message):
            calculate(expression)


class TestAnswerGrader:
    @pytest.mark.parametrize(
        ("answer", "label", "reward"),
        [
            ("The answer is 1,530.", "1530", 1.0),
            ("It is 2.50", "2.5", 1.0),
            ("The answer is 12.", "13", 0.0),
            ("I cannot answer.", "13", 0.0),
            ("Paris.", "paris", 1.0),
        ],
    )
    async def test_compares_the_final_answer_with_the_label(
        self, answer: str, label: str, reward: float
    ) -> None:
        """The last number of the final assistant message is compared with the label."""
        sample = Sample(
            messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
        )
        await AnswerGrader().grade(GraderContext(rollout_id="r", label=label, sample=sample))
        assert sample.reward == reward

    async def test_needs_a_label(self) -> None:
        """Grading without a label is a clear ValueError."""
        with pytest.raises(ValueError, match="needs a label"):
            await AnswerGrader().grade(GraderContext(rollout_id="r", label=None, sample=Sample()))


def misbehaving_chat(
    kind: str, status: int = 500, traceparents: list[str | None] | None = None
) -> web.Application:
    """A chat endpoint that always calls a tool (``loop``) or always fails (``error``) with
    ``status``; it keeps each request's ``traceparent`` header in ``traceparents`` when given."""

    async def completions(request: web.Request) -> web.Response:
        if traceparents is not None:
            traceparents.append(request.headers.get("traceparent"))
        if kind == "error":
            return web.json_response({"error": {"message": "model crashed"}}, status=status)
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "1+1"})},
        }
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return web.json_response(
            {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}
        )

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


class TestCalculatorAgent:
    @pytest.mark.parametrize("stream", [False, True])
    async def test_solves_a_question_with_the_stand_in(
        self, aiohttp_server: Any, serve_rollout: Any, tmp_path: Path, stream: bool
    ) -> None:
        """Tool call, tool result, final answer: graded 1.0, streamed or not."""
        standin = load_standin()
        chat = await aiohttp_server(standin.create_app(standin.StandinConfig()), host="127.0.0.1")
        server = await serve_rollout(backend(tmp_path, stream=stream))
        result = await run_one(
            server.url, str(chat.make_url("/v1")), "What is the product of 24 and 82?", "1968"
        )
        assert result.status == "success", result.err_message
        assert result.sample.reward == 1.0
        roles = [m["role"] for m in result.sample.messages]
        assert roles == ["user", "assistant", "tool", "assistant"]
        assert json.loads(result.sample.messages[2]["content"])["result"] == "1968"
        assert result.sample.metrics == {"turns": 2, "tool_calls": 1}

    async def test_turn_limit_is_a_clear_agent_error(
        self, aiohttp_server: Any, serve_rollout: Any, tmp_path: Path
    ) -> None:
        """A model that never stops calling tools fails the rollout after max_turns calls."""
        chat = await aiohttp_server(misbehaving_chat("loop"), host="127.0.0.1")
        server = await serve_rollout(backend(tmp_path, max_turns=2))
        result = await run_one(server.url, str(chat.make_url("/v1")), "q", "2")
        assert result.status == "failure"
        assert result.err_category == "agent_error"
        assert "no final answer after 2 model calls" in result.err_message

    @pytest.mark.parametrize(
        ("status", "category"),
        [(500, "http_error"), (429, "http_error"), (401, "http_error"), (400, "agent_error")],
    )
    async def test_chat_errors_fail_the_rollout_with_the_status(
        self, aiohttp_server: Any, serve_rollout: Any, tmp_path: Path, status: int, category: str
    ) -> None:
        """A chat endpoint that keeps answering an error fails the rollout, naming status and
        detail: an infrastructure failure (http_error) for 5xx, 429 and a refused key, the
        agent's failure for a request the endpoint refused (400)."""
        chat = await aiohttp_server(misbehaving_chat("error", status), host="127.0.0.1")
        server = await serve_rollout(backend(tmp_path, max_retries=0))
        result = await run_one(server.url, str(chat.make_url("/v1")), "q", "2")
        assert result.status == "failure"
        assert result.err_category == category
        assert f"returned {status}: model crashed" in result.err_message

    @pytest.mark.parametrize("key", [None, "wrong"])
    async def test_a_refused_model_lookup_names_the_key(
        self, aiohttp_server: Any, serve_rollout: Any, tmp_path: Path, key: str | None
    ) -> None:
        """A 401 from GET /models fails the rollout saying the key was rejected (or that the
        rollout carries none), not pointing at the 'model' setting."""

        async def refuse(_request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)

        app = web.Application()
        app.router.add_get("/v1/models", refuse)
        chat = await aiohttp_server(app, host="127.0.0.1")
        server = await serve_rollout(backend(tmp_path, max_retries=0))
        async with RolloutClient(url=server.url, admission_timeout_sec=30) as client:
            result = await client.run_rollout(
                initial_messages=[{"role": "user", "content": "q"}],
                chat_completions_url=str(chat.make_url("/v1")),
                rollout_id=uuid.uuid4().hex,
                label="2",
                agent_timeout_sec=30,
                grader_timeout_sec=10,
                llm_api_key=key,
            )
        assert result.status == "failure"
        assert result.err_category == "http_error"
        expected = "rejected the rollout's API key" if key else "needs an API key"
        assert f"returned 401: the model endpoint {expected}" in result.err_message
        assert "--llm-api-key-env" in result.err_message
        assert "skip this lookup" not in result.err_message

    @pytest.mark.parametrize("model", [None, "m"])
    async def test_unreachable_chat_endpoint_is_an_http_error(
        self, serve_rollout: Any, tmp_path: Path, model: str | None
    ) -> None:
        """A chat endpoint nobody listens on fails the rollout as http_error (infrastructure,
        not the agent), whether the agent first asks for the model list or not."""
        with socket.socket() as bound_not_listening:
            bound_not_listening.bind(("127.0.0.1", 0))
            port = bound_not_listening.getsockname()[1]
            server = await serve_rollout(backend(tmp_path, max_retries=0, model=model))
            result = await run_one(server.url, f"http://127.0.0.1:{port}/v1", "q", "2")
        assert result.status == "failure"
        assert result.err_category == "http_error"
        assert "failed: ClientConnectorError" in result.err_message

    async def test_each_model_call_is_a_span_whose_traceparent_reaches_the_model(
        self, aiohttp_server: Any, serve_rollout: Any, tmp_path: Path
    ) -> None:
        """On a tracing server, each of the agent's model calls is a client span under the
        workflow's span, and the chat endpoint receives that span's traceparent."""
        traceparents: list[str | None] = []
        chat = await aiohttp_server(
            misbehaving_chat("loop", traceparents=traceparents), host="127.0.0.1"
        )
        exporter = InMemorySpanExporter()
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        try:
            server = await serve_rollout(
                backend(tmp_path, max_turns=2, model="m"), tracer_provider=provider
            )
            result = await run_one(server.url, str(chat.make_url("/v1")), "q", "2")
        finally:
            provider.shutdown()
        assert result.err_category == "agent_error"
        spans = exporter.get_finished_spans()
        (workflow,) = [span for span in spans if span.name == "workflow"]
        calls = sorted(
            (span for span in spans if span.name == "chat m"), key=lambda s: s.start_time or 0
        )
        assert len(calls) == 2
        assert all(call.kind is SpanKind.CLIENT for call in calls)
        assert workflow.context is not None
        assert {call.parent.span_id for call in calls if call.parent} == {workflow.context.span_id}
        assert [str(value).split("-")[1:3] for value in traceparents] == [
            [f"{call.context.trace_id:032x}", f"{call.context.span_id:016x}"]
            for call in calls
            if call.context is not None
        ]


class TestBackendSettings:
    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("EXAMPLE_AGENT_MAX_CONCURRENT", "abc"),
            ("EXAMPLE_AGENT_MAX_CONCURRENT", "0"),
            ("EXAMPLE_AGENT_MAX_TURNS", "-1"),
            ("EXAMPLE_AGENT_MAX_QUEUED", "x"),
        ],
    )
    def test_a_bad_variable_exits_with_one_line(
        self, monkeypatch: pytest.MonkeyPatch, name: str, value: str
    ) -> None:
        """A bad setting ends `rollout-server serve` with one line naming the variable: a
        SystemExit, which the server reports without a traceback."""
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as caught:
            create_backend()
        message = str(caught.value.code)
        assert message == (
            f"calculator_agent: environment variable {name} must be an integer of at least "
            f"{0 if name == 'EXAMPLE_AGENT_MAX_QUEUED' else 1}, got {value!r}"
        )
        assert caught.value.__cause__ is None
        assert "\n" not in message

    def test_valid_variables_configure_the_backend(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Valid values reach the backend (the slots the server reports on /health)."""
        monkeypatch.setenv("EXAMPLE_AGENT_MAX_CONCURRENT", "3")
        monkeypatch.setenv("EXAMPLE_AGENT_MAX_QUEUED", "0")
        backend = create_backend()
        assert backend.max_concurrent == 3


class TestModelOutageInEval:
    async def test_dead_chat_url_leaves_items_pending_and_the_right_url_resumes(
        self, aiohttp_server: Any, serve_rollout: Any, tmp_path: Path
    ) -> None:
        """A run whose --chat-url is dead from the start scores nothing: every item fails as
        http_error and stays pending, the run exits 1 and says how to resume, and the same
        run with the right URL runs every item (it used to find them all done, as zeros)."""
        rows = (ROOT / "examples" / "datasets" / "arithmetic.jsonl").read_text().splitlines()
        dataset = tmp_path / "five.jsonl"
        dataset.write_text("\n".join(rows[:5]) + "\n")
        server = await serve_rollout(backend(tmp_path, max_retries=0))
        with socket.socket() as bound_not_listening:
            bound_not_listening.bind(("127.0.0.1", 0))
            dead_url = f"http://127.0.0.1:{bound_not_listening.getsockname()[1]}/v1"
            first = await run_eval(
                EvalOptions(
                    dataset=dataset,
                    server_url=server.url,
                    chat_url=dead_url,
                    output=tmp_path / "out",
                    concurrency=2,
                    progress="off",
                ),
                stream=io.StringIO(),
            )
        assert first.exit_code == 1
        assert first.summary["by_outcome"]["infra_failure"] == 5
        assert first.summary["by_err_category"] == {"http_error": 5}
        assert first.summary["items"]["scored"] == 0
        assert first.closing_line is not None
        assert first.closing_line.endswith("; 5 items pending. Re-run the same command to resume.")

        standin = load_standin()
        chat = await aiohttp_server(standin.create_app(standin.StandinConfig()), host="127.0.0.1")
        second = await run_eval(
            EvalOptions(
                dataset=dataset,
                server_url=server.url,
                chat_url=str(chat.make_url("/v1")),
                output=tmp_path / "out",
                concurrency=2,
                progress="off",
            ),
            stream=io.StringIO(),
        )
        assert second.exit_code == 0
        assert second.summary["complete"] is True
        assert second.summary["by_outcome"]["success"] == 5
        assert second.summary["pass"]["passed"] == 5
        assert second.closing_line is None
