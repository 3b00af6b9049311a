"""A local stand-in for an OpenAI-compatible model server, for the demo and the tests.

**This is not a model.** It stands in for a real chat-completions server such as vLLM
or SGLang so that the demo and the tests run on a laptop in seconds, with no GPU and no
network. It speaks the same HTTP API (``POST /v1/chat/completions``, streaming and
non-streaming, with tool calls; ``GET /v1/models``) and "solves" the arithmetic questions
of ``examples/datasets/arithmetic.jsonl`` by rule:

1. It reads the last ``user`` message and turns it into an arithmetic expression
   (``"What is 17 * 23?"``, ``"the sum of 128 and 256"``, ``"15 percent of 240"``, a few
   word-problem templates).
2. If the request offers a function tool (``calculator`` preferred, else the first one) and
   no tool result has come back yet, it answers with one tool call whose arguments are
   ``{"<first string parameter, normally 'expression'>": "17 * 23"}``
   (``finish_reason: "tool_calls"``).
3. When the last message is the ``tool`` result, it answers ``"The answer is 391."``
   (``finish_reason: "stop"``). Without tools it computes the answer itself, with the
   example agent's own calculator (``examples/calculator_agent/calculator.py``).

To make rewards vary it gives a wrong final answer with probability ``--error-rate``. The
decision is a pure function of ``(seed, question, how many times this process has
answered that question)``, so a fresh stand-in reproduces the same results in any
scheduling order, while repeated runs of one question (``rollout-eval --n K``) differ.
``--http-500-rate`` and ``--http-429-rate`` inject server errors and rate limiting, and
``--latency-ms`` adds a (jittered) delay to every response.

Token ids and logprobs, as vLLM returns them, when a request asks (for trainer-side tests):

* ``return_token_ids: true``: the response carries ``prompt_token_ids`` (top level; in the
  first chunk of a stream) and ``choices[0].token_ids`` (in each chunk, the ids of that
  chunk's delta);
* ``logprobs: true``: ``choices[0].logprobs.content`` holds one entry per completion token
  (``{"token", "logprob", "bytes", "top_logprobs": []}``); with
  ``return_tokens_as_token_ids: true`` each ``token`` is ``"token_id:<id>"``.

The "tokenizer" is a toy (words, punctuation and runs of white space, each hashed to an id
below :data:`VOCAB_SIZE`) applied to a fixed rendering of the chat (:func:`render_prompt`);
the completion's tokens are those of its streamed pieces, in order, whether the call
streams or not. Logprobs are a pure function of the seed, the prompt and the position, so
one request always gets the same numbers. With ``--weight-version V`` every response also
reports ``"metadata": {"weight_version": V}`` (as SGLang does). :func:`produced` lists what
was returned to the requests that asked, for tests to compare against.

Run it::

    python tools/chat_standin/server.py --host 127.0.0.1 --port 0 --port-file /tmp/p \\
        --error-rate 0.1 --latency-ms 20 --seed 0

and point agents at ``http://127.0.0.1:<port>/v1`` (they call ``.../chat/completions``).
SIGTERM or SIGINT stops it cleanly (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import fractions
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from aiohttp import web

__all__ = [
    "MODEL_ID",
    "VOCAB_SIZE",
    "StandinConfig",
    "create_app",
    "main",
    "produced",
    "question_to_expression",
    "render_prompt",
    "serve",
    "tokenize",
]

MODEL_ID: Final = "chat-standin"
"""The model id the stand-in reports in ``/v1/models`` and in every completion."""

VOCAB_SIZE: Final = 32000
"""Token ids of the toy tokenizer are in ``[100, VOCAB_SIZE)`` (ids below 100 are unused)."""

_TOKEN: Final = re.compile(r"\w+|[^\w\s]|\s+")


def _token_id(piece: str) -> int:
    digest = hashlib.sha256(piece.encode()).digest()
    return 100 + int.from_bytes(digest[:4], "big") % (VOCAB_SIZE - 100)


def tokenize(text: str) -> list[int]:
    """The toy tokenizer: each word, punctuation mark or run of white space, hashed to an id."""
    return [_token_id(piece) for piece in _TOKEN.findall(text)]


def render_prompt(body: dict[str, Any]) -> str:
    """The toy chat template: each message as ``<|role|>content[tool calls][call id]<|end|>``,
    the tool names, then ``<|assistant|>`` (the prompt whose tokens ``prompt_token_ids`` are).
    """
    parts = []
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        text = f"<|{message.get('role')}|>{_text_of(message.get('content'))}"
        if message.get("tool_calls"):
            text += json.dumps(message["tool_calls"], sort_keys=True)
        if message.get("tool_call_id"):
            text += f"[{message['tool_call_id']}]"
        parts.append(text + "<|end|>")
    names = [
        str(tool.get("function", {}).get("name"))
        for tool in body.get("tools") or ()
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
    ]
    if names:
        parts.append(f"<|tools|>{' '.join(names)}<|end|>")
    return "".join(parts) + "<|assistant|>"


_NUMBER = r"(-?\d+(?:\.\d+)?)"
_RULES: Final[tuple[tuple[re.Pattern[str], str], ...]] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (rf"{_NUMBER}\s*(?:percent|%)\s+of\s+{_NUMBER}", r"(\1 * \2 / 100)"),
        (rf"the\s+sum\s+of\s+{_NUMBER}\s+and\s+{_NUMBER}", r"(\1 + \2)"),
        (rf"the\s+product\s+of\s+{_NUMBER}\s+and\s+{_NUMBER}", r"(\1 * \2)"),
        (rf"the\s+difference\s+between\s+{_NUMBER}\s+and\s+{_NUMBER}", r"(\1 - \2)"),
        (rf"the\s+quotient\s+of\s+{_NUMBER}\s+and\s+{_NUMBER}", r"(\1 / \2)"),
        (rf"the\s+remainder\s+when\s+{_NUMBER}\s+is\s+divided\s+by\s+{_NUMBER}", r"(\1 % \2)"),
        (rf"the\s+square\s+of\s+{_NUMBER}", r"(\1 * \1)"),
        (rf"the\s+cube\s+of\s+{_NUMBER}", r"(\1 * \1 * \1)"),
        (rf"{_NUMBER}\s+squared", r"(\1 * \1)"),
        (rf"{_NUMBER}\s+cubed", r"(\1 * \1 * \1)"),
        # Word-problem templates of the demo dataset.
        (rf"costs?\s+{_NUMBER}\s+dollars?\b.*?\b{_NUMBER}\s+\w+\s+cost", r"(\1 * \2)"),
        (rf"{_NUMBER}\s+\w+\s+with\s+{_NUMBER}\s+\w+\s+in\s+each", r"(\1 * \2)"),
        (rf"had\s+{_NUMBER}\b.*?\bgave\s+away\s+{_NUMBER}", r"(\1 - \2)"),
        (
            rf"travels?\s+{_NUMBER}\s+\w+\s+(?:an|per)\s+hour\s+for\s+{_NUMBER}\s+hours?",
            r"(\1 * \2)",
        ),
        (
            rf"{_NUMBER}\s+\w+\s+(?:are\s+)?shared\s+equally\s+(?:among|between)\s+{_NUMBER}",
            r"(\1 / \2)",
        ),
        (rf"{_NUMBER}\s+divided\s+by\s+{_NUMBER}", r"(\1 / \2)"),
        (rf"{_NUMBER}\s+(?:times|multiplied\s+by)\s+{_NUMBER}", r"(\1 * \2)"),
        (rf"{_NUMBER}\s+plus\s+{_NUMBER}", r"(\1 + \2)"),
        (rf"{_NUMBER}\s+minus\s+{_NUMBER}", r"(\1 - \2)"),
    )
)
_EXPRESSION = re.compile(r"[-+*/%().\d\s]+")


class ExpressionError(ValueError):
    """The text holds no arithmetic expression the stand-in can evaluate."""


def _load_calculator() -> ModuleType:
    """The example agent's calculator module, loaded from its file.

    The stand-in evaluates with the very calculator the example agent offers as its tool
    (``examples/calculator_agent/calculator.py``, standard library only). It is loaded by
    path, not as ``calculator_agent.calculator``, so that the stand-in needs neither
    ``examples/`` on ``sys.path`` nor the agent's own imports (rollout-server).
    """
    path = Path(__file__).resolve().parents[2] / "examples" / "calculator_agent" / "calculator.py"
    spec = importlib.util.spec_from_file_location("chat_standin_calculator", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the example calculator from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CALCULATOR: Final = _load_calculator()


def question_to_expression(question: str) -> str:
    """Turn a question into an arithmetic expression (``+ - * / %``, parentheses).

    Raises:
        ExpressionError: If no expression can be found.
    """
    text = question.lower().replace("\u00d7", "*").replace("\u00f7", "/").replace(",", "")
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    candidates = []
    for match in _EXPRESSION.finditer(text):
        chunk = match.group().strip().rstrip(".").strip()
        if re.search(r"\d", chunk):
            candidates.append(chunk)
    for chunk in sorted(candidates, key=len, reverse=True):
        try:
            _CALCULATOR.calculate(chunk)
        except _CALCULATOR.CalculatorError:
            continue
        return " ".join(chunk.split())
    raise ExpressionError(f"no arithmetic expression in {question!r}")


_TOOL_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _number_in_tool_result(content: Any) -> fractions.Fraction | None:
    text = _text_of(content)
    try:
        data = json.loads(text)
    except (ValueError, TypeError):
        data = None
    if isinstance(data, int | float) and not isinstance(data, bool) and math.isfinite(data):
        return fractions.Fraction(str(data))
    if isinstance(data, dict):
        if data.get("error"):
            return None
        for key in ("result", "value", "answer"):
            value = data.get(key)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                return fractions.Fraction(str(value))
            if isinstance(value, str):
                text = value
                break
    if "error" in text.lower():
        return None
    numbers = _TOOL_NUMBER.findall(text)
    if not numbers:
        return None
    try:
        return fractions.Fraction(numbers[-1])
    except ValueError:
        return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return "" if content is None else str(content)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Tokens:
    """The token fields one completion returns (None: not asked for)."""

    prompt_token_ids: list[int] | None
    logprobs: bool
    as_ids: bool
    seed: int
    digest: str

    def entries(self, ids: list[int], text_pieces: list[str], start: int) -> list[dict[str, Any]]:
        """The ``logprobs.content`` entries of ``ids`` (starting at completion position
        ``start``)."""
        out = []
        for offset, (token, piece) in enumerate(zip(ids, text_pieces, strict=True)):
            position = start + offset
            value = -round(_unit(self.seed, "logprob", self.digest, position, token) * 4.0, 6)
            shown = f"token_id:{token}" if self.as_ids else piece
            out.append(
                {
                    "token": shown,
                    "logprob": value,
                    "bytes": list(piece.encode()),
                    "top_logprobs": [],
                }
            )
        return out


def _tokens_asked(state: _State, body: dict[str, Any]) -> _Tokens | None:
    ids = body.get("return_token_ids") is True
    logprobs = body.get("logprobs") is True
    if not (ids or logprobs):
        return None
    prompt = render_prompt(body)
    return _Tokens(
        prompt_token_ids=tokenize(prompt) if ids else None,
        logprobs=logprobs,
        as_ids=body.get("return_tokens_as_token_ids") is True,
        seed=state.config.seed,
        digest=hashlib.sha256(prompt.encode()).hexdigest()[:16],
    )


def _delta_text(delta: dict[str, Any]) -> str:
    """The generated text of one streamed delta (what its tokens are)."""
    if isinstance(delta.get("content"), str):
        return str(delta["content"])
    text = ""
    for call in delta.get("tool_calls") or ():
        function = call.get("function") or {}
        text += str(function.get("name") or "") + str(function.get("arguments") or "")
    return text


def _delta_tokens(
    tokens: _Tokens, delta: dict[str, Any], start: int
) -> tuple[list[int], list[dict[str, Any]]]:
    pieces = _TOKEN.findall(_delta_text(delta))
    ids = [_token_id(piece) for piece in pieces]
    return ids, tokens.entries(ids, pieces, start) if tokens.logprobs else []


def _error(
    status: int, message: str, type_: str, headers: dict[str, str] | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)


def _unit(*parts: object) -> float:
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _pick_tool(body: dict[str, Any]) -> tuple[str, str] | None:
    """The (name, argument name) of the tool to call, or None when no function tool is offered."""
    if body.get("tool_choice") == "none":
        return None
    tools = [
        t
        for t in body.get("tools") or ()
        if isinstance(t, dict) and t.get("type", "function") == "function"
    ]
    functions: list[dict[str, Any]] = [
        t["function"] for t in tools if isinstance(t.get("function"), dict)
    ]
    if not functions:
        return None
    chosen = next((f for f in functions if f.get("name") == "calculator"), functions[0])
    properties = (chosen.get("parameters") or {}).get("properties") or {}
    argument = (
        "expression" if "expression" in properties or not properties else next(iter(properties))
    )
    return str(chosen.get("name", "calculator")), argument


def _decide(state: _State, body: dict[str, Any]) -> dict[str, Any]:
    """The assistant message (content or tool_calls) for a chat request."""
    messages = [m for m in body["messages"] if isinstance(m, dict)]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        return {"role": "assistant", "content": "Please ask me an arithmetic question."}
    question = _text_of(messages[last_user].get("content"))
    after = messages[last_user + 1 :]
    tool_results = [m for m in after if m.get("role") == "tool"]
    tool = _pick_tool(body)
    if tool_results:
        value = _number_in_tool_result(tool_results[-1].get("content"))
        if value is None:
            return {
                "role": "assistant",
                "content": "The calculator reported an error, so I cannot answer.",
            }
        return {"role": "assistant", "content": _final_answer(state, question, value)}
    try:
        expression = question_to_expression(question)
    except ExpressionError:
        return {
            "role": "assistant",
            "content": "I cannot find an arithmetic question in that message.",
        }
    if tool is not None:
        name, argument = tool
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    # Deterministic (a digest of the prompt), so a rerun's prompts repeat.
                    "id": f"call_{hashlib.sha256(render_prompt(body).encode()).hexdigest()[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps({argument: expression})},
                }
            ],
        }
    try:
        value = _CALCULATOR.calculate(expression)
    except _CALCULATOR.CalculatorError:
        return {"role": "assistant", "content": "That expression cannot be evaluated."}
    return {"role": "assistant", "content": _final_answer(state, question, value)}


def _final_answer(state: _State, question: str, value: fractions.Fraction) -> str:
    occurrence = state.answered[question]
    state.answered[question] += 1
    config = state.config
    if _unit(config.seed, "wrong", question, occurrence) < config.error_rate:
        value += 1 + int(_unit(config.seed, "delta", question, occurrence) * 9)
    return f"The answer is {_CALCULATOR.format_number(value)}."


def _usage(body: dict[str, Any], message: dict[str, Any]) -> dict[str, int]:
    prompt = sum(
        len(_text_of(m.get("content")).split()) + 3 for m in body["messages"] if isinstance(m, dict)
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
    message = _decide(state, body)
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
    tokens = _tokens_asked(state, body)
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
        for delta in _deltas(message):
            more, logprobs = _delta_tokens(tokens, delta, len(ids))
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
    tokens: _Tokens,
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


def _pieces(text: str, size: int = 8) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    if message.get("tool_calls"):
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(message["tool_calls"]):
            head = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            first: dict[str, Any] = {"tool_calls": [head]}
            if index == 0:
                first = {"role": "assistant", "content": None, **first}
            deltas.append(first)
            deltas.extend(
                {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                for piece in _pieces(call["function"]["arguments"])
            )
        return deltas
    return [{"role": "assistant", "content": ""}] + [
        {"content": piece} for piece in _pieces(message["content"] or "")
    ]


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

    tokens = _tokens_asked(state, body)
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
    async for delta in _aiter(_deltas(message)):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": None,
        }
        extra: dict[str, Any] = {}
        if tokens is not None:
            more, logprobs = _delta_tokens(tokens, delta, len(ids))
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


def _write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n", encoding="utf-8")
    tmp.replace(path)


async def serve(config: StandinConfig, *, host: str, port: int, port_file: Path | None) -> None:
    """Serve until SIGTERM or SIGINT; write the bound port to ``port_file`` once listening."""
    runner = web.AppRunner(create_app(config), handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        if port_file is not None:
            _write_port_file(port_file, bound)
        print(f"chat stand-in listening on http://{host}:{bound}/v1", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        print("chat stand-in stopping", flush=True)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Command line: see ``--help``."""
    parser = argparse.ArgumentParser(
        description="Local OpenAI-compatible chat-completions stand-in (NOT a model: a rule-based "
        "stand-in for vLLM/SGLang that answers arithmetic questions with tool calls)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=0, help="port to bind; 0 picks a free one (default 0)"
    )
    parser.add_argument(
        "--port-file", type=Path, help="write the bound port to this file once listening"
    )
    parser.add_argument(
        "--error-rate", type=float, default=0.0, help="probability of a wrong final answer"
    )
    parser.add_argument(
        "--http-500-rate", type=float, default=0.0, help="probability of an HTTP 500 answer"
    )
    parser.add_argument(
        "--http-429-rate", type=float, default=0.0, help="probability of an HTTP 429 answer"
    )
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="mean added delay per response, ms"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of every random decision (default 0)"
    )
    parser.add_argument(
        "--weight-version",
        metavar="V",
        help="report this weights version in every response (metadata.weight_version)",
    )
    parser.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="require 'Authorization: Bearer $NAME' on every request",
    )
    args = parser.parse_args(argv)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    try:
        config = StandinConfig(
            error_rate=args.error_rate,
            http_500_rate=args.http_500_rate,
            http_429_rate=args.http_429_rate,
            latency_ms=args.latency_ms,
            seed=args.seed,
            api_key=api_key,
            weight_version=args.weight_version,
        )
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(serve(config, host=args.host, port=args.port, port_file=args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
