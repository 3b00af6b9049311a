"""A rollout server with a model gateway: each rollout's workflow calls its own route, the
turns reach trajectory.json and (only when asked) the result, and a caller that does not
ask sees exactly the result a server without a gateway sends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowOutput,
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    LocalBackend,
    ModelEndpointError,
    ModelGateway,
    Sample,
    WorkflowContext,
    get_rollout_context,
)
from rollout_types import (
    PROTOCOL_VERSION_HEADER,
    RolloutResultResponse,
    RolloutStatus,
    dumps,
    loads,
    structure_wire,
)

from .standin_loader import load_standin

STANDIN = load_standin()
QUESTION = "What is 17 * 23?"
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip


class TwoCalls(AgentWorkflow):
    """Two model calls through ``ctx.base_url``: a tool call, then the answer (a fake
    calculator result); fails after the first call when the prompt says ``fail``."""

    seen_base_urls: ClassVar[list[str]] = []

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        assert ctx.base_url == get_rollout_context().base_url
        TwoCalls.seen_base_urls.append(ctx.base_url)
        messages = list(ctx.prompt)
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(
                    f"{ctx.base_url}/chat/completions",
                    json={"model": "m", "messages": messages, "tools": TOOLS},
                ) as response:
                    if response.status != 200:
                        raise ModelEndpointError("model call failed", status_code=response.status)
                    reply = (await response.json())["choices"][0]["message"]
                messages.append(reply)
                if "fail" in messages[0]["content"]:
                    raise RuntimeError("the workflow gives up after one call")
                if reply.get("tool_calls"):
                    call = reply["tool_calls"][0]
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "391"})
        return AgentWorkflowOutput(messages=messages, metrics={"calls": 2})


@pytest.fixture
async def standin() -> Any:
    app = STANDIN.create_app(STANDIN.StandinConfig(seed=1))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield app, str(server.make_url("/v1"))
    await server.close()


def rollout_body(rollout_id: str, url: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "initial_messages": [{"role": "user", "content": QUESTION}],
        "rollout_id": rollout_id,
        "chat_completions_url": url,
        "grade": False,
    }
    body.update(fields)
    return body


async def run(harness: Any, body: dict[str, Any]) -> Any:
    reply = await harness.post_rollout(body)
    assert reply.status == 202, reply
    return await harness.poll_until(
        body["rollout_id"], reply.json["polling_lease_token"], "success", "failure"
    )


class TestGatewayServer:
    async def test_turns_in_the_result_and_the_trajectory(
        self, make_harness: Any, standin: Any, tmp_path: Path
    ) -> None:
        """Asked for, the result carries each call's token ids and logprobs exactly as the
        stand-in made them, and trajectory.json's agent steps carry the same."""
        app, url = standin
        gateway = ModelGateway()
        harness = await make_harness(
            LocalBackend(TwoCalls, artifact_root=tmp_path), model_gateway=gateway
        )
        reply = await run(
            harness, rollout_body("r1", url, return_turns=True, weight_version="step-3")
        )
        assert reply.json["status"] == "success"
        result = loads(reply.raw)
        turns = reply.json["turns"]
        made = STANDIN.produced(app)
        assert len(turns) == len(made) == 2
        for index, (turn, produced) in enumerate(zip(turns, made, strict=True)):
            assert turn["index"] == index
            assert turn["prompt_token_ids"] == produced["prompt_token_ids"]
            assert turn["completion_token_ids"] == produced["completion_token_ids"]
            assert turn["logprobs"] == produced["logprobs"]
            assert turn["weight_version"] == "step-3"
            assert turn["flags"] == []
            assert turn["endpoint"] == url
        assert turns[0]["request_messages"] == [{"role": "user", "content": QUESTION}]
        assert result["sample"]["messages"][1] == turns[0]["response_message"]
        assert TwoCalls.seen_base_urls[-1].startswith(gateway.url)
        assert gateway.open_routes == 0  # closed with the rollout

        trajectory = json.loads((tmp_path / "r1" / "trajectory.json").read_text())
        agent = [step for step in trajectory["steps"] if step["source"] == "agent"]
        assert [step["metrics"]["completion_token_ids"] for step in agent] == [
            produced["completion_token_ids"] for produced in made
        ]
        assert [step["metrics"]["logprobs"] for step in agent] == [p["logprobs"] for p in made]
        assert [step["metrics"]["prompt_token_ids"] for step in agent] == [
            p["prompt_token_ids"] for p in made
        ]
        listed = trajectory["extra"]["rollout_server"]["model_turns"]
        assert [entry["step_id"] for entry in listed] == [step["step_id"] for step in agent]
        atif = pytest.importorskip("atif")
        atif.Trajectory.model_validate(trajectory)

    async def test_without_the_opt_in_the_result_is_todays(
        self, make_harness: Any, standin: Any, tmp_path: Path
    ) -> None:
        """A caller that does not ask gets byte-for-byte the result a server without a
        gateway sends for the same rollout (the 1.0 document: no ``turns`` key)."""
        _, url = standin
        with_gateway = await make_harness(
            LocalBackend(TwoCalls, artifact_root=tmp_path / "a"), model_gateway=ModelGateway()
        )
        without = await make_harness(LocalBackend(TwoCalls, artifact_root=tmp_path / "b"))
        first = await run(with_gateway, rollout_body("same", url))
        second = await run(without, rollout_body("same", url))
        assert first.json["status"] == "success"
        assert first.raw == second.raw
        assert list(first.json) == ["rollout_id", "status", "sample", "err_message", "err_category"]
        parsed = structure_wire(loads(first.raw), RolloutResultResponse)
        assert parsed.turns is None
        assert dumps(parsed).encode() == first.raw  # the converter's 1.0 encoding
        # The trajectory of the gateway's rollout has the turns anyway.
        trajectory = json.loads((tmp_path / "a" / "same" / "trajectory.json").read_text())
        assert "model_turns" in trajectory["extra"]["rollout_server"]
        assert (
            "model_turns"
            not in json.loads((tmp_path / "b" / "same" / "trajectory.json").read_text())["extra"][
                "rollout_server"
            ]
        )

    async def test_a_failed_rollout_keeps_its_turns(
        self, make_harness: Any, standin: Any, tmp_path: Path
    ) -> None:
        """A workflow that fails after one call: failure as before, with that one turn."""
        _, url = standin
        harness = await make_harness(
            LocalBackend(TwoCalls, artifact_root=tmp_path), model_gateway=ModelGateway()
        )
        body = rollout_body("f1", url, return_turns=True)
        body["initial_messages"] = [{"role": "user", "content": f"{QUESTION} fail"}]
        reply = await run(harness, body)
        assert reply.json["status"] == "failure"
        assert reply.json["err_category"] == "agent_error"
        assert len(reply.json["turns"]) == 1

    async def test_an_endpoint_outage_is_an_http_error(
        self, make_harness: Any, tmp_path: Path
    ) -> None:
        """An unreachable endpoint behind the gateway: the workflow sees 502, the rollout
        fails as http_error (infrastructure), and the turn says unreachable."""
        harness = await make_harness(
            LocalBackend(TwoCalls, artifact_root=tmp_path), model_gateway=ModelGateway()
        )
        reply = await run(harness, rollout_body("down", "http://127.0.0.1:9/v1", return_turns=True))
        assert reply.json["status"] == "failure"
        assert reply.json["err_category"] == "http_error"
        (turn,) = reply.json["turns"]
        assert turn["flags"][0] == "unreachable"

    async def test_return_turns_without_a_gateway_is_refused(self, make_harness: Any) -> None:
        """A server that captures nothing says so (422) instead of answering no turns."""
        harness = await make_harness(LocalBackend(TwoCalls))
        reply = await harness.post_rollout(
            rollout_body("r", "http://127.0.0.1:9/v1", return_turns=True)
        )
        assert reply.status == 422
        (error,) = reply.json["detail"]
        assert error["loc"] == ["body", "return_turns"]
        assert "--gateway" in error["msg"]

    async def test_the_server_advertises_protocol_11(self, make_harness: Any) -> None:
        """The version header names the protocol with turns."""
        harness = await make_harness(LocalBackend(TwoCalls), model_gateway=ModelGateway())
        reply = await harness.health()
        assert reply.headers[PROTOCOL_VERSION_HEADER] == "1.1"

    def test_model_gateway_must_be_a_gateway(self) -> None:
        """A wrong object is a TypeError at construction."""
        from rollout_server import create_rollout_server

        with pytest.raises(TypeError, match="ModelGateway"):
            create_rollout_server(backend=LocalBackend(TwoCalls), model_gateway=object())  # type: ignore[arg-type]


class TestGatewaySettings:
    def test_model_endpoints_build_the_gateway(self) -> None:
        """model_endpoints (a setting) implies a gateway over those endpoints; gateway=True
        alone makes one without endpoints; neither, none."""
        from rollout_server import ROLLOUT_SERVER_KEY, create_rollout_server

        urls = ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1/"]
        server = create_rollout_server(backend=LocalBackend(TwoCalls), model_endpoints=urls)[
            ROLLOUT_SERVER_KEY
        ]
        assert isinstance(server.model_router, ModelGateway)
        assert server.model_router.endpoints == (
            "http://127.0.0.1:8001/v1",
            "http://127.0.0.1:8002/v1",
        )
        assert server.settings.model_endpoints == tuple(urls)
        plain = create_rollout_server(backend=LocalBackend(TwoCalls), gateway=True)
        router = plain[ROLLOUT_SERVER_KEY].model_router
        assert isinstance(router, ModelGateway)
        assert router.endpoints == ()
        none = create_rollout_server(backend=LocalBackend(TwoCalls))[ROLLOUT_SERVER_KEY]
        assert none.model_router is None

    @pytest.mark.parametrize(
        ("endpoints", "error", "match"),
        [
            ("http://one/v1", TypeError, "list or tuple"),
            (["gpu-0:8000"], ValueError, "not an http"),
            (["http://a/v1", "http://a/v1/"], ValueError, "duplicate"),
        ],
    )
    def test_bad_endpoints(self, endpoints: Any, error: type[Exception], match: str) -> None:
        """A bare string, a URL without http(s) or a duplicate is refused, by name."""
        from rollout_server import ServerSettings

        with pytest.raises(error, match=match):
            ServerSettings(model_endpoints=endpoints)

    def test_endpoints_and_a_gateway_instance_clash(self) -> None:
        """Endpoints go to one place: the setting or the instance, not both."""
        from rollout_server import ServerConfigError, create_rollout_server

        with pytest.raises(ServerConfigError, match="both given"):
            create_rollout_server(
                backend=LocalBackend(TwoCalls),
                model_endpoints=["http://a/v1"],
                model_gateway=ModelGateway(),
            )


class RemoteLikeBackend(ExecutionBackend):
    """A backend that, like a RayBackend worker, never reads the server's ambient context:
    it calls the model at ``request.chat_completions_url`` itself."""

    seen: ClassVar[list[ExecutionRequest]] = []

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        RemoteLikeBackend.seen.append(request)
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{request.chat_completions_url}/chat/completions",
                json={"messages": request.prompt},
            ) as response,
        ):
            reply = (await response.json())["choices"][0]["message"]
        return ExecutionOutcome(
            workflow=ExecutionResult(
                status=RolloutStatus.SUCCESS,
                sample=Sample(messages=[*request.prompt, reply], trajectory_messages=[]),
            )
        )


async def test_a_backend_with_its_own_context_calls_the_route(
    make_harness: Any, standin: Any
) -> None:
    """The request a backend receives names the rollout's route (and carries the weight
    version and group), so a backend that builds its own context (a worker process) is
    captured too."""
    app, url = standin
    harness = await make_harness(RemoteLikeBackend(), model_gateway=ModelGateway())
    reply = await run(
        harness, rollout_body("w1", url, return_turns=True, weight_version="7", group_id="g")
    )
    assert reply.json["status"] == "success"
    request = RemoteLikeBackend.seen[-1]
    assert (request.weight_version, request.group_id) == ("7", "g")
    assert request.chat_completions_url != url  # the route, not the caller's URL
    (turn,) = reply.json["turns"]
    assert turn["completion_token_ids"] == STANDIN.produced(app)[0]["completion_token_ids"]
