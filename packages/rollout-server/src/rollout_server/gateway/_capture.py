"""What a model call's answer says, for its captured turn: the assistant message, the
finish reason, token ids, logprobs and the weights' version, read from a chat completion
(:func:`read_completion`) or assembled from its server-sent-event stream
(:class:`StreamReader`), with a :class:`~rollout_types.TurnFlag` for each thing missing or
malformed. Nothing here raises on bad input: a bad answer is a flagged turn.

The fields read are those vLLM and SGLang return on their OpenAI-compatible chat API:

* ``prompt_token_ids``: top level (in the first chunk of a stream), or on the choice;
* completion token ids: ``choices[0].token_ids`` (per chunk in a stream); else, when
  logprobs were requested with ``return_tokens_as_token_ids``, the ``token_id:<id>`` form
  of each ``logprobs.content[i].token``;
* logprobs: ``choices[0].logprobs.content[i].logprob`` (per chunk in a stream);
* the weights' version: ``metadata.weight_version`` (SGLang) or a top-level
  ``weight_version``, when it is a non-empty string (or an integer).

Only the first choice is read (``n`` > 1 is not captured). Logprobs whose count differs
from the completion token ids' are dropped as malformed: misaligned logprobs would poison
a trainer's importance ratios.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

import attrs

from rollout_types import TurnFlag

__all__ = ["AnswerParts", "StreamReader", "read_completion"]

_TOKEN_ID_PREFIX: Final = "token_id:"  # noqa: S105 - a model token, not a secret


class _Malformed:
    """A field that came back, but not in a usable form."""


MALFORMED: Final = _Malformed()


@attrs.define(kw_only=True)
class AnswerParts:
    """What one answer says (see the module docstring); None where it says nothing."""

    response_message: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    weight_version: str | None = None
    flags: list[TurnFlag] = attrs.Factory(list)

    def flag(self, flag: TurnFlag) -> None:
        """Add ``flag`` once."""
        if flag not in self.flags:
            self.flags.append(flag)


def _token_ids(value: Any) -> list[int] | _Malformed | None:
    if value is None:
        return None
    if type(value) is not list or not all(type(v) is int and v >= 0 for v in value):
        return MALFORMED
    return value


def _logprob_entries(value: Any) -> tuple[list[float], list[int] | None] | _Malformed | None:
    """The logprobs of ``logprobs.content``, and the token ids its ``token_id:<id>``
    tokens name (None unless every token has that form)."""
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) else MALFORMED
    if content is None:
        return None
    if type(content) is not list:
        return MALFORMED
    logprobs: list[float] = []
    ids: list[int] | None = []
    for entry in content:
        if not isinstance(entry, dict):
            return MALFORMED
        logprob: Any = entry.get("logprob")
        if type(logprob) not in (int, float) or not math.isfinite(logprob) or logprob > 0:
            return MALFORMED
        logprobs.append(float(logprob))
        token = entry.get("token")
        digits = (
            token[len(_TOKEN_ID_PREFIX) :]
            if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX)
            else ""
        )
        if ids is not None and digits.isdigit():
            ids.append(int(digits))
        else:
            ids = None
    return logprobs, ids


def _weight_version(document: dict[str, Any]) -> str | None:
    metadata = document.get("metadata")
    for value in (
        metadata.get("weight_version") if isinstance(metadata, dict) else None,
        document.get("weight_version"),
    ):
        if isinstance(value, str) and value:
            return value
        if type(value) is int:
            return str(value)
    return None


def _finish(parts: AnswerParts, ids_from_tokens: list[int] | None) -> AnswerParts:
    """Fill the completion ids from the logprob tokens when nothing else gave them, check
    the alignment, and flag what is missing."""
    if (
        parts.completion_token_ids is None
        and ids_from_tokens
        and TurnFlag.MALFORMED_TOKEN_IDS not in parts.flags
    ):
        parts.completion_token_ids = ids_from_tokens
    if (
        parts.logprobs is not None
        and parts.completion_token_ids is not None
        and len(parts.logprobs) != len(parts.completion_token_ids)
    ):
        parts.logprobs = None
        parts.flag(TurnFlag.MALFORMED_LOGPROBS)
    if parts.prompt_token_ids is None:
        parts.flag(TurnFlag.NO_PROMPT_TOKEN_IDS)
    if parts.completion_token_ids is None:
        parts.flag(TurnFlag.NO_COMPLETION_TOKEN_IDS)
    if parts.logprobs is None:
        parts.flag(TurnFlag.NO_LOGPROBS)
    return parts


def read_completion(body: bytes) -> AnswerParts:
    """The parts of a (non-streamed) chat completion document."""
    parts = AnswerParts()
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        document = None
    choices = document.get("choices") if isinstance(document, dict) else None
    choice = choices[0] if type(choices) is list and choices else None
    if not isinstance(document, dict) or not isinstance(choice, dict):
        parts.flag(TurnFlag.NOT_A_COMPLETION)
        return _finish(parts, None)
    message = choice.get("message")
    if isinstance(message, dict):
        parts.response_message = message
    else:
        parts.flag(TurnFlag.NOT_A_COMPLETION)
    finish = choice.get("finish_reason")
    parts.finish_reason = finish if isinstance(finish, str) else None
    parts.weight_version = _weight_version(document)
    prompt = _token_ids(
        document["prompt_token_ids"]
        if "prompt_token_ids" in document
        else choice.get("prompt_token_ids")
    )
    completion = _token_ids(choice.get("token_ids"))
    for name, value in (("prompt_token_ids", prompt), ("completion_token_ids", completion)):
        if value is MALFORMED:
            parts.flag(TurnFlag.MALFORMED_TOKEN_IDS)
        elif isinstance(value, list):
            setattr(parts, name, value)
    entries = _logprob_entries(choice.get("logprobs"))
    ids_from_tokens = None
    if entries is MALFORMED:
        parts.flag(TurnFlag.MALFORMED_LOGPROBS)
    elif isinstance(entries, tuple):
        parts.logprobs, ids_from_tokens = entries
    return _finish(parts, ids_from_tokens)


class StreamReader:
    """Assemble the parts of a streamed chat completion from its bytes, as they pass.

    Feed every chunk of the body to :meth:`feed`; :meth:`finish` says what the stream
    held. Memory: the assembled message, ids and logprobs, plus one partial line.

    Args:
        max_bytes: Stop assembling past this many bytes of stream (the turn is then
            flagged ``too_large``, its parts dropped); the bytes still pass.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._seen = 0
        self._partial = b""
        self._done = False
        self._parts = AnswerParts()
        self._role = "assistant"
        self._content: list[str] | None = None
        self._reasoning: list[str] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._ids: list[int] | None = None
        self._ids_bad = False
        self._logprobs: list[float] | None = None
        self._token_ids: list[int] | None = []
        self._logprobs_bad = False
        self._events = 0

    @property
    def done(self) -> bool:
        """Whether the stream's ``data: [DONE]`` has arrived."""
        return self._done

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the stream."""
        if self._parts.flags and TurnFlag.TOO_LARGE in self._parts.flags:
            return
        self._seen += len(chunk)
        if self._seen > self._max_bytes:
            self._drop()
            return
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line.strip())

    def _drop(self) -> None:
        self._parts = AnswerParts(flags=[TurnFlag.TOO_LARGE])
        self._content = self._reasoning = self._ids = self._logprobs = None
        self._calls = {}
        self._partial = b""

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self._done = True
            return
        try:
            event = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            self._parts.flag(TurnFlag.NOT_A_COMPLETION)
            return
        if not isinstance(event, dict):
            self._parts.flag(TurnFlag.NOT_A_COMPLETION)
            return
        self._event(event)

    def _event(self, event: dict[str, Any]) -> None:
        parts = self._parts
        self._events += 1
        if "error" in event:
            parts.flag(TurnFlag.UPSTREAM_ERROR)
        version = _weight_version(event)
        if version is not None:
            parts.weight_version = version
        if "prompt_token_ids" in event:
            prompt = _token_ids(event["prompt_token_ids"])
            if isinstance(prompt, list):
                parts.prompt_token_ids = prompt
            elif prompt is MALFORMED:
                parts.flag(TurnFlag.MALFORMED_TOKEN_IDS)
        choices = event.get("choices")
        if type(choices) is not list:
            return
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        parts = self._parts
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            parts.finish_reason = finish
        if parts.prompt_token_ids is None and "prompt_token_ids" in choice:
            prompt = _token_ids(choice["prompt_token_ids"])
            if isinstance(prompt, list):
                parts.prompt_token_ids = prompt
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self._delta(delta)
        if "token_ids" in choice and not self._ids_bad:
            ids = _token_ids(choice["token_ids"])
            if ids is MALFORMED:
                self._ids_bad = True
                self._ids = None
                parts.flag(TurnFlag.MALFORMED_TOKEN_IDS)
            elif isinstance(ids, list):
                self._ids = (self._ids or []) + ids
        if choice.get("logprobs") is not None and not self._logprobs_bad:
            entries = _logprob_entries(choice["logprobs"])
            if entries is MALFORMED:
                self._logprobs_bad = True
                self._logprobs = self._token_ids = None
                parts.flag(TurnFlag.MALFORMED_LOGPROBS)
            elif isinstance(entries, tuple):
                logprobs, ids = entries
                self._logprobs = (self._logprobs or []) + logprobs
                if ids is None or self._token_ids is None:
                    self._token_ids = None
                else:
                    self._token_ids += ids

    def _delta(self, delta: dict[str, Any]) -> None:
        role = delta.get("role")
        if isinstance(role, str):
            self._role = role
        for key in ("content", "reasoning_content"):
            piece = delta.get(key)
            if isinstance(piece, str):
                pieces = self._content if key == "content" else self._reasoning
                if pieces is None:
                    pieces = []
                    if key == "content":
                        self._content = pieces
                    else:
                        self._reasoning = pieces
                pieces.append(piece)
        calls = delta.get("tool_calls")
        if type(calls) is not list:
            return
        for part in calls:
            if not isinstance(part, dict):
                continue
            index = part.get("index", 0)
            call = self._calls.setdefault(
                index if type(index) is int else 0,
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if isinstance(part.get("id"), str) and part["id"]:
                call["id"] = part["id"]
            function = part.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    call["function"]["name"] += function["name"]
                if isinstance(function.get("arguments"), str):
                    call["function"]["arguments"] += function["arguments"]

    def finish(self, *, broken: bool) -> AnswerParts:
        """The parts of the stream so far.

        Args:
            broken: Whether the stream broke off (the connection dropped); a stream that
                ended without ``[DONE]`` or a finish reason counts as broken too.
        """
        parts = self._parts
        if TurnFlag.TOO_LARGE in parts.flags:
            return parts
        if self._partial.strip():
            self._line(self._partial.strip())
            self._partial = b""
        if broken or not (self._done or parts.finish_reason is not None):
            parts.flag(TurnFlag.DISCONNECTED)
        if self._events == 0:
            parts.flag(TurnFlag.NOT_A_COMPLETION)
        else:
            message: dict[str, Any] = {
                "role": self._role,
                "content": None if self._content is None else "".join(self._content),
            }
            if self._reasoning is not None:
                message["reasoning_content"] = "".join(self._reasoning)
            if self._calls:
                message["tool_calls"] = [self._calls[index] for index in sorted(self._calls)]
            parts.response_message = message
        parts.completion_token_ids = self._ids
        parts.logprobs = self._logprobs
        return _finish(parts, self._token_ids)
