"""The example workflow: a multi-turn chat agent that can call a calculator tool.

Each turn sends the conversation to ``<chat_completions_url>/chat/completions`` (found in
the ambient rollout context, with the request's ``llm_api_key`` as bearer token) and offers
the ``calculator`` tool; each call runs inside the context's ``model_call()``, so a tracing
server records it as a span and the model server receives its ``traceparent``. Tool calls
in the reply are executed and their results appended as ``tool`` messages; the loop ends
at the first reply without tool calls (the final answer), or fails after ``max_turns``
model calls.

Settings (the workflow config's extra keys):

* ``model``: model name to request; default: the first id ``GET <url>/models`` lists;
* ``max_turns``: most model calls per rollout (default 6);
* ``stream``: request server-sent-event streaming (default False);
* ``temperature``: sampling temperature (default 0.0);
* ``max_tokens``: completion token limit, or None (default None);
* ``request_timeout_sec``: bound on one model call (default 60.0);
* ``max_retries``: retries of a model call after 429, 5xx or a dropped connection
  (default 2; the delay honours ``Retry-After``, at most 5 s).

Failures are clear exceptions: :class:`ChatEndpointError` (a
:class:`~rollout_server.ModelEndpointError`, so the server tells an unreachable or failing
endpoint, ``http_error``, from the agent's own failures) for an endpoint that cannot be
reached, an HTTP error or an answer that is not a chat completion, ``RuntimeError`` when the
turn limit is reached, and ``TimeoutError`` when a model call exceeds its bound.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowOutput,
    ModelEndpointError,
    WorkflowContext,
    get_rollout_context,
)

from .calculator import TOOL_SPEC, CalculatorError, calculate, format_number

__all__ = ["DEFAULTS", "CalculatorAgent", "ChatEndpointError"]

DEFAULTS: Final[dict[str, Any]] = {
    "model": None,
    "max_turns": 6,
    "stream": False,
    "temperature": 0.0,
    "max_tokens": None,
    "request_timeout_sec": 60.0,
    "max_retries": 2,
}
"""Default of each setting (see the module docstring)."""

MAX_RETRY_DELAY_SEC: Final = 5.0
_RETRY_STATUSES: Final = frozenset({429, 500, 502, 503, 504})


class ChatEndpointError(ModelEndpointError):
    """The chat-completions endpoint failed, answered with an error or with something unusable.

    A :class:`~rollout_server.ModelEndpointError`: the server reports it as ``http_error`` (an
    infrastructure failure, not scored) when there is no ``status_code`` (unreachable, no
    usable answer) or the status is 401, 402, 403, 404, 408, 429 or 5xx, and as
    ``agent_error`` for other statuses (the endpoint refused the request the agent built).
    """


def _error_detail(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(data.get("detail"), str):
            return str(data["detail"])
    return text[:300]


def _retry_delay(response: aiohttp.ClientResponse | None, attempt: int) -> float:
    delay = 0.25 * 2**attempt
    if response is not None:
        try:
            advertised = float(response.headers.get("Retry-After", ""))
        except ValueError:
            advertised = math.nan
        if math.isfinite(advertised):
            delay = advertised
    return float(min(max(delay, 0.0), MAX_RETRY_DELAY_SEC))


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise ChatEndpointError(
                f"the stream sent an event that is not JSON: {data[:200]!r}"
            ) from None
        if isinstance(event, dict):
            yield event


async def _read_stream(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """Assemble one assistant message from a streamed chat completion."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    async for event in _sse_events(response):
        if isinstance(event.get("error"), dict):
            raise ChatEndpointError(f"the stream reported an error: {event['error']}")
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                content.append(delta["content"])
            for part in delta.get("tool_calls") or ():
                call = calls.setdefault(
                    int(part.get("index", 0)),
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if part.get("id"):
                    call["id"] = part["id"]
                function = part.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message


def _message_of(body: Any) -> dict[str, Any]:
    try:
        message = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise ChatEndpointError(
            "the chat endpoint's answer has no choices[0].message; is the URL an "
            "OpenAI-compatible chat-completions base URL (ending in /v1)?"
        ) from None
    if not isinstance(message, dict):
        raise ChatEndpointError("choices[0].message in the chat endpoint's answer is not an object")
    # Drop the nulls and empty lists some servers add (refusal, reasoning_content,
    # tool_calls=[]), so the message can be sent back as conversation history as is.
    return {
        key: value
        for key, value in message.items()
        if key == "content" or (value is not None and value != [])
    }


def _run_tool(call: dict[str, Any]) -> str:
    """Execute one tool call; errors become a JSON error result the model can read."""
    function = call.get("function") or {}
    name = function.get("name")
    if name != "calculator":
        return json.dumps({"error": f"unknown tool {name!r}; the only tool is 'calculator'"})
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        return json.dumps({"error": "the arguments are not valid JSON"})
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        return json.dumps({"error": "pass the expression as a string argument 'expression'"})
    try:
        value = calculate(expression)
    except CalculatorError as exc:
        return json.dumps({"error": str(exc)})
    return json.dumps({"expression": expression, "result": format_number(value)})


class CalculatorAgent(AgentWorkflow):
    """A chat agent with a calculator tool; see the module docstring for its settings."""

    def setting(self, key: str) -> Any:
        """The value of one setting: the config's extra key, else :data:`DEFAULTS`."""
        if self.config is not None and key in self.config.extra:
            return self.config.extra[key]
        return DEFAULTS[key]

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        """Converse with the model until it gives a final answer (see the module docstring).

        Raises:
            ChatEndpointError: When the endpoint fails (after retries) or answers badly.
            RuntimeError: When no final answer came within ``max_turns`` model calls.
            TimeoutError: When one model call exceeds ``request_timeout_sec``.
        """
        rollout = get_rollout_context()
        base = rollout.chat_completions_url.rstrip("/")
        if not base:
            raise ValueError(
                "the rollout has no chat_completions_url: pass the model server's base URL "
                "(for example http://127.0.0.1:8000/v1)"
            )
        headers = {"Authorization": f"Bearer {rollout.api_key}"} if rollout.api_key else {}
        messages = [dict(message) for message in ctx.prompt]
        max_turns = int(self.setting("max_turns"))
        tool_calls = 0
        timeout = aiohttp.ClientTimeout(total=float(self.setting("request_timeout_sec")))
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            model = self.setting("model") or await self._first_model(session, base)
            for turn in range(1, max_turns + 1):
                reply = await self._complete(session, base, model, messages)
                messages.append(reply)
                calls = reply.get("tool_calls") or []
                if not calls:
                    return AgentWorkflowOutput(
                        messages=messages,
                        metrics={"turns": turn, "tool_calls": tool_calls},
                        info={"model": model},
                    )
                for call in calls:
                    tool_calls += 1
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.get("id", ""),
                            "content": _run_tool(call),
                        }
                    )
        raise RuntimeError(
            f"no final answer after {max_turns} model calls ({tool_calls} tool calls); the model "
            "kept calling tools: raise max_turns or check the model's tool use"
        )

    async def _first_model(self, session: aiohttp.ClientSession, base: str) -> str:
        try:
            async with session.get(f"{base}/models") as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise ChatEndpointError(f"GET {base}/models failed: {exc!r}") from exc
        if status in (401, 403):
            key = (
                "rejected the rollout's API key (llm_api_key: rollout-eval's --llm-api-key-env)"
                if session.headers.get("Authorization")
                else "needs an API key and the rollout carries none (llm_api_key: "
                "rollout-eval's --llm-api-key-env)"
            )
            raise ChatEndpointError(
                f"GET {base}/models returned {status}: the model endpoint {key}: "
                f"{_error_detail(text)}",
                status_code=status,
            )
        if status != 200:
            raise ChatEndpointError(
                f"GET {base}/models returned {status}: {_error_detail(text)}; set the "
                "workflow setting 'model' to skip this lookup",
                status_code=status,
            )
        try:
            return str(json.loads(text)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ChatEndpointError(
                f"GET {base}/models listed no model; set the workflow setting 'model'"
            ) from None

    async def _complete(
        self,
        session: aiohttp.ClientSession,
        base: str,
        model: str,
        messages: list[dict[str, Any]],
    ) -> dict[str, Any]:
        stream = bool(self.setting("stream"))
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "tools": [TOOL_SPEC],
            "tool_choice": "auto",
            "temperature": float(self.setting("temperature")),
            "stream": stream,
        }
        if self.setting("max_tokens") is not None:
            body["max_tokens"] = int(self.setting("max_tokens"))
        retries = int(self.setting("max_retries"))
        url = f"{base}/chat/completions"
        rollout = get_rollout_context()
        for attempt in range(retries + 1):
            last = attempt == retries
            try:
                with rollout.model_call(model) as trace_headers:
                    async with session.post(url, json=body, headers=trace_headers) as response:
                        if response.status in _RETRY_STATUSES and not last:
                            await asyncio.sleep(_retry_delay(response, attempt))
                            continue
                        if response.status != 200:
                            detail = _error_detail(await response.text())
                            raise ChatEndpointError(
                                f"POST {url} returned {response.status}: {detail}",
                                status_code=response.status,
                            )
                        if stream:
                            return await _read_stream(response)
                        return _message_of(await response.json(content_type=None))
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                if last:
                    raise ChatEndpointError(f"POST {url} failed: {exc!r}") from exc
                await asyncio.sleep(_retry_delay(None, attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")
