"""The chat stand-in's HTTP API (see ``server.py``): its configuration
(:class:`StandinConfig`), the aiohttp application (:func:`create_app`) with
``POST /v1/chat/completions`` (whole or streamed, with token ids and logprobs when asked),
``GET /v1/models`` and ``GET /health``, injected errors and delays, and what it returned
to the requests that asked for tokens (:func:`produced`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, Final

from aiohttp import web
from standin_answers import decide
from standin_tokens import Tokens, delta_tokens, deltas, text_of, tokens_asked

__all__ = ["MODEL_ID", "StandinConfig", "create_app", "produced"]

MODEL_ID: Final = "chat-standin"
"""The model id the stand-in reports in ``/v1/models`` and in every completion."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StandinConfig:
    """Behaviour of the stand-in.

    Rates are probabilities in [0, 1]; ``latency_ms`` is the mean added delay per response
    (jittered uniformly between 0.5x and 1.5x); ``api_key`` (if set) must come as
    ``Authorization: Bearer <api_key>``.
    """

    error_rate: float = 0.0
    http_500_rate: float = 0.0
    http_429_rate: float = 0.0
    latency_ms: float = 0.0
    seed: int = 0
    api_key: str | None = None
    weight_version: str | None = None

    def __post_init__(self) -> None:
        for name in ("error_rate", "http_500_rate", "http_429_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"{name} must be within [0, 1], got {value!r}")
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ValueError(f"latency_ms must be a finite number >= 0, got {self.latency_ms!r}")


@dataclasses.dataclass
class _State:
    config: StandinConfig
    rng: random.Random
    answered: Counter[str] = dataclasses.field(default_factory=Counter)
    requests: int = 0
    completions: int = 0
    produced: list[dict[str, Any]] = dataclasses.field(default_factory=list)


_STATE: Final = web.AppKey("standin_state", _State)


def produced(app: web.Application) -> list[dict[str, Any]]:
    """What the stand-in returned to each request that asked for token ids or logprobs, in
    order: ``{"id", "prompt_token_ids", "completion_token_ids", "logprobs"}`` (a key the
    request did not ask for is None)."""
    return app[_STATE].produced


def _error(
    status: int, message: str, type_: str, headers: dict[str, str] | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)


def _usage(body: dict[str, Any], message: dict[str, Any]) -> dict[str, int]:
    prompt = sum(
        len(text_of(m.get("content")).split()) + 3 for m in body["messages"] if isinstance(m, dict)
    )
    completion = len(json.dumps(message).split())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _models(request: web.Request) -> web.Response:
    if (denied := _check_auth(request)) is not None:
        return denied
    return web.json_response(
        {
            "object": "list",
            "data": [
                {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "rollout-examples"}
            ],
        }
    )


async def _health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _check_auth(request: web.Request) -> web.Response | None:
    key = request.app[_STATE].config.api_key
    if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
        return _error(401, "Incorrect API key provided.", "invalid_request_error")
    return None


async def _delay(state: _State) -> None:
    latency = state.config.latency_ms
    if latency > 0:
        await asyncio.sleep(latency / 1000 * state.rng.uniform(0.5, 1.5))


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[_STATE]
    state.requests += 1
    if (denied := _check_auth(request)) is not None:
        return denied
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "The request body is not valid JSON.", "invalid_request_error")
    if (
        not isinstance(body, dict)
        or not isinstance(body.get("messages"), list)
        or not body["messages"]
    ):
        return _error(
            400, "'messages' must be a non-empty array of message objects.", "invalid_request_error"
        )
    roll = state.rng.random()
    if roll < state.config.http_429_rate:
        return _error(
            429,
            "Rate limit reached (injected by the chat stand-in).",
            "rate_limit_error",
            {"Retry-After": "1"},
        )
    if roll < state.config.http_429_rate + state.config.http_500_rate:
        return _error(500, "Internal error (injected by the chat stand-in).", "server_error")
    message = decide(
        body,
        seed=state.config.seed,
        error_rate=state.config.error_rate,
        answered=state.answered,
    )
    state.completions += 1
    requested = body.get("model")
    model = requested if isinstance(requested, str) else MODEL_ID
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await _stream(
            request,
            state=state,
            body=body,
            message=message,
            completion_id=completion_id,
            created=created,
            model=model,
            finish=finish,
            include_usage=include_usage,
        )
    tokens = tokens_asked(state.config.seed, body)
    await _delay(state)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
    }
    document: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(body, message),
    }
    if state.config.weight_version is not None:
        document["metadata"] = {"weight_version": state.config.weight_version}
    if tokens is not None:
        ids: list[int] = []
        entries: list[dict[str, Any]] = []
        for delta in deltas(message):
            more, logprobs = delta_tokens(tokens, delta, len(ids))
            ids += more
            entries += logprobs
        if tokens.prompt_token_ids is not None:
            document["prompt_token_ids"] = tokens.prompt_token_ids
            choice["token_ids"] = ids
        if tokens.logprobs:
            choice["logprobs"] = {"content": entries}
        _record(state, completion_id, tokens, ids, entries)
    return web.json_response(document)


def _record(
    state: _State,
    completion_id: str,
    tokens: Tokens,
    ids: list[int],
    entries: list[dict[str, Any]],
) -> None:
    asked_ids = tokens.prompt_token_ids is not None
    state.produced.append(
        {
            "id": completion_id,
            "prompt_token_ids": tokens.prompt_token_ids,
            "completion_token_ids": ids if asked_ids else None,
            "logprobs": [entry["logprob"] for entry in entries] if tokens.logprobs else None,
        }
    )


async def _stream(
    request: web.Request,
    *,
    state: _State,
    body: dict[str, Any],
    message: dict[str, Any],
    completion_id: str,
    created: int,
    model: str,
    finish: str,
    include_usage: bool,
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    tokens = tokens_asked(state.config.seed, body)
    reported = state.config.weight_version

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        document = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
            **extra,
        }
        if reported is not None:
            document["metadata"] = {"weight_version": reported}
        return f"data: {json.dumps(document)}\n\n".encode()

    await _delay(state)
    ids: list[int] = []
    entries: list[dict[str, Any]] = []
    first = True
    async for delta in _aiter(deltas(message)):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": None,
        }
        extra: dict[str, Any] = {}
        if tokens is not None:
            more, logprobs = delta_tokens(tokens, delta, len(ids))
            ids += more
            entries += logprobs
            if tokens.prompt_token_ids is not None:
                choice["token_ids"] = more
                if first:
                    extra["prompt_token_ids"] = tokens.prompt_token_ids
            if tokens.logprobs:
                choice["logprobs"] = {"content": logprobs}
        first = False
        await response.write(chunk([choice], **extra))
    await response.write(
        chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}])
    )
    if tokens is not None:
        _record(state, completion_id, tokens, ids, entries)
    if include_usage:
        await response.write(chunk([], usage=_usage(body, message)))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _aiter(items: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for item in items:
        yield item
        await asyncio.sleep(0)


def create_app(config: StandinConfig | None = None) -> web.Application:
    """Build the stand-in's aiohttp application.

    Routes: ``POST /v1/chat/completions`` (also ``/chat/completions``), ``GET /v1/models``,
    ``GET /health``.
    """
    config = config or StandinConfig()
    app = web.Application()
    app[_STATE] = _State(config=config, rng=random.Random(config.seed))
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/models", _models)
    app.router.add_get("/health", _health)
    return app
