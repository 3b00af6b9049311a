"""Failures to reach the policy model are ``http_error`` (infrastructure), never the agent's:
the model-endpoint rules of ``categorize_exception``, and LocalBackend applying them."""

from __future__ import annotations

import asyncio
import pickle
import socket
import urllib.error
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowOutput,
    ExecutionRequest,
    LocalBackend,
    ModelEndpointError,
    WorkflowContext,
    categorize_exception,
    get_rollout_context,
)
from rollout_types import RolloutErrorCategory, RolloutStatus

HTTP = RolloutErrorCategory.HTTP_ERROR
AGENT = RolloutErrorCategory.AGENT_ERROR
TIMEOUT = RolloutErrorCategory.TIMEOUT
VALIDATION = RolloutErrorCategory.VALIDATION_ERROR


def named(module: str, *names: str) -> type[Exception]:
    """A class chain ``names[-1] <- ... <- names[0]`` whose classes claim ``module``, the way
    httpx's or the OpenAI SDK's exceptions look to a server that does not import them."""
    base: type[Exception] = Exception
    for name in names:
        base = type(name, (base,), {"__module__": module})
    return base


def httpx_error(*names: str, status: int | None = None) -> Exception:
    """An exception shaped like httpx's: ``HTTPStatusError`` carries ``response.status_code``."""
    error = named("httpx._exceptions", "HTTPError", *names)("failed")
    if status is not None:
        error.response = type("Response", (), {"status_code": status})()
    return error


def httpx_transport(*names: str) -> Exception:
    """An httpx ``TransportError`` subclass (``RequestError <- TransportError <- names``)."""
    return httpx_error("RequestError", "TransportError", *names)


def sdk_error(*names: str, status: int | None = None) -> Exception:
    """An exception shaped like the OpenAI or Anthropic SDK's (``status_code`` on status errors)."""
    error = named("openai._exceptions", "OpenAIError", "APIError", *names)("failed")
    if status is not None:
        error.status_code = status
    return error


def url_http_error(code: int) -> urllib.error.HTTPError:
    return urllib.error.HTTPError("http://127.0.0.1:9/v1", code, "status", Message(), None)


def response_error(status: int) -> aiohttp.ClientResponseError:
    info = aiohttp.RequestInfo(
        url=URL("http://127.0.0.1:9/v1"), method="POST", headers=CIMultiDictProxy(CIMultiDict())
    )
    return aiohttp.ClientResponseError(info, (), status=status, message="status")


class TestModelEndpointCategories:
    @pytest.mark.parametrize(
        ("exc", "category"),
        [
            # The documented base class: no status or an infrastructure status.
            (ModelEndpointError("unreachable"), HTTP),
            *[(ModelEndpointError("s", status_code=code), HTTP) for code in (401, 402, 403)],
            *[(ModelEndpointError("s", status_code=code), HTTP) for code in (404, 408, 429)],
            *[(ModelEndpointError("s", status_code=code), HTTP) for code in (500, 503, 599)],
            *[(ModelEndpointError("s", status_code=code), AGENT) for code in (400, 413, 422)],
            # stdlib connection failures and urllib status errors.
            (ConnectionRefusedError(111, "refused"), HTTP),
            (ConnectionResetError(104, "reset"), HTTP),
            (BrokenPipeError(32, "pipe"), HTTP),
            (socket.gaierror(-2, "Name or service not known"), HTTP),
            (urllib.error.URLError("refused"), HTTP),
            (url_http_error(502), HTTP),
            (url_http_error(401), HTTP),
            (url_http_error(400), AGENT),
            # aiohttp: connection failures, raise_for_status(), connect vs read timeouts.
            (aiohttp.ClientConnectorError(None, OSError(111, "refused")), HTTP),
            (aiohttp.ServerDisconnectedError(), HTTP),
            (aiohttp.ClientPayloadError("truncated"), HTTP),
            (aiohttp.ClientConnectionError("refused"), HTTP),
            (response_error(503), HTTP),
            (response_error(429), HTTP),
            (response_error(403), HTTP),
            (response_error(400), AGENT),
            (aiohttp.ServerTimeoutError("read"), TIMEOUT),
            (aiohttp.ConnectionTimeoutError("connect"), HTTP),
            (aiohttp.InvalidURL("not a url"), VALIDATION),
            # httpx, recognised by name (not imported).
            (httpx_transport("NetworkError", "ConnectError"), HTTP),
            (httpx_transport("ProtocolError", "RemoteProtocolError"), HTTP),
            (httpx_transport("TimeoutException", "ConnectTimeout"), HTTP),
            (httpx_transport("TimeoutException", "PoolTimeout"), HTTP),
            (httpx_transport("TimeoutException", "ReadTimeout"), TIMEOUT),
            (httpx_transport("TimeoutException", "WriteTimeout"), TIMEOUT),
            (httpx_error("HTTPStatusError", status=502), HTTP),
            (httpx_error("HTTPStatusError", status=401), HTTP),
            (httpx_error("HTTPStatusError", status=400), AGENT),
            (httpx_error("HTTPStatusError", status=None), AGENT),
            # OpenAI / Anthropic SDKs, by name.
            (sdk_error("APIConnectionError"), HTTP),
            (sdk_error("APIConnectionError", "APITimeoutError"), TIMEOUT),
            (sdk_error("APIStatusError", "RateLimitError", status=429), HTTP),
            (sdk_error("APIStatusError", "InternalServerError", status=500), HTTP),
            (sdk_error("APIStatusError", "AuthenticationError", status=401), HTTP),
            (sdk_error("APIStatusError", "BadRequestError", status=400), AGENT),
            # Not the model endpoint: unchanged.
            (FileNotFoundError(2, "missing"), AGENT),
            (named("mylib", "TransportError")("not httpx"), AGENT),
            (RuntimeError("boom"), AGENT),
        ],
    )  # fmt: skip
    def test_categories(self, exc: BaseException, category: RolloutErrorCategory) -> None:
        """Each kind of model-endpoint failure gets the category of the documented table."""
        assert categorize_exception(exc) is category

    def test_subclass_of_the_base_class(self) -> None:
        """An agent's own subclass of ModelEndpointError is classified by its status."""

        class ChatFailedError(ModelEndpointError):
            pass

        assert categorize_exception(ChatFailedError("busy", status_code=503)) is HTTP
        assert categorize_exception(ChatFailedError("too long", status_code=400)) is AGENT

    def test_status_code_survives_pickling(self) -> None:
        """A ModelEndpointError crossing a process boundary keeps its message and status."""
        error = ModelEndpointError("busy", status_code=503)
        copy = pickle.loads(pickle.dumps(error))  # noqa: S301 - our own bytes
        assert (str(copy), copy.status_code) == ("busy", 503)


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A loopback URL whose port is bound but not listening: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


class AskTheModel(AgentWorkflow):
    """Posts the prompt to the rollout's chat endpoint with aiohttp (no error handling)."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        url = get_rollout_context().chat_completions_url + "/chat/completions"
        async with aiohttp.ClientSession() as session:
            response = await session.post(url, json={"messages": ctx.prompt})
            response.raise_for_status()
            return AgentWorkflowOutput(messages=[*ctx.prompt, await response.json()])


class TestLocalBackendModelFailures:
    async def test_unreachable_model_endpoint_is_an_http_error(
        self, tmp_path: Path, refused_url: str
    ) -> None:
        """A workflow whose chat endpoint refuses connections fails as http_error."""
        backend = LocalBackend(workflow=AskTheModel, artifact_root=tmp_path)
        request = ExecutionRequest(
            id="r1",
            prompt=[{"role": "user", "content": "hi"}],
            chat_completions_url=refused_url,
            llm_api_key=None,
            label=None,
            grade=False,
            on_status=lambda _status: None,
        )
        async with asyncio.timeout(10):
            outcome = await backend.execute(request)
        result: Any = outcome.reported()
        assert result.status is RolloutStatus.FAILURE
        assert result.err_category is HTTP
        await backend.shutdown()
