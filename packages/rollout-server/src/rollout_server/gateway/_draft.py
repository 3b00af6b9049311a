"""What the gateway keeps of a route and of a chat completion in flight: the state of one
open route (:class:`RouteState`: its endpoint, its ring key, its calls so far) and the turn
a call becomes (:class:`TurnDraft`): the request's messages noted, token ids and logprobs
asked for when the workflow did not, the answer read
(:mod:`rollout_server.gateway._capture`), and the :class:`~rollout_types.RolloutTurn`
recorded on the route, in call order, when the call ends.
"""

from __future__ import annotations

import bisect
import json
import time
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import attrs

from rollout_types import RolloutTurn, TurnFlag

from ..execution._turns import ModelRoute
from ._capture import AnswerParts, read_completion

__all__ = ["TOKEN_KNOBS", "RouteState", "TurnDraft", "public_url"]

TOKEN_KNOBS: Final = ("logprobs", "return_token_ids")
"""What the gateway asks for when the workflow did not (vLLM's names; SGLang reads them)."""


def public_url(url: str) -> str:
    """``url`` without credentials (the ``endpoint`` a turn records)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit(parts._replace(netloc=netloc))


@attrs.define(kw_only=True, eq=False)
class RouteState:
    """The gateway's state of one open route."""

    route: ModelRoute
    endpoint: str
    ring_key: str | None
    weight_version: str | None
    calls: int = 0
    public_endpoint: str = attrs.field(
        default=attrs.Factory(lambda self: public_url(self.endpoint), takes_self=True)
    )
    """``endpoint`` without credentials (what each turn records), worked out once."""


@attrs.define(kw_only=True, eq=False)
class TurnDraft:
    """One chat completion call in flight, recorded as a turn when it ends."""

    state: RouteState
    index: int
    started: float
    messages: list[Any] = attrs.Factory(list)
    status_code: int | None = None
    parts: AnswerParts = attrs.Factory(AnswerParts)
    recorded: bool = False

    def read_request(self, body: bytes, *, ask_tokens: bool) -> bytes:
        """Note the request's messages; return the body to send (asking for token ids and
        logprobs unless the request already says)."""
        try:
            document = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            document = None
        if not isinstance(document, dict):
            self.parts.flag(TurnFlag.UNPARSED_REQUEST)
            return body
        messages = document.get("messages")
        if isinstance(messages, list):
            self.messages = messages
        if not ask_tokens:
            return body
        missing = [key for key in TOKEN_KNOBS if key not in document]
        if not missing:
            return body
        # Spliced in after the opening brace: the rest of the body goes on byte for byte
        # (and is not encoded again).
        if body.lstrip()[:1] != b"{":  # not UTF-8 (json reads UTF-16 and -32 too)
            document.update(dict.fromkeys(missing, True))
            return json.dumps(document, ensure_ascii=False).encode()
        head = b"".join(b'"%s":true,' % key.encode() for key in missing)
        start = body.index(b"{") + 1
        if not document:
            head = head[:-1]  # "{}": no member follows
        return body[:start] + head + body[start:]

    def answer(self, status: int, data: bytes) -> None:
        """Take a whole answer."""
        if status >= 400:
            self.parts.flag(TurnFlag.UPSTREAM_ERROR)
            return
        self.merge(read_completion(data))

    def merge(self, parts: AnswerParts) -> None:
        """Take what the answer said, keeping the flags noted so far."""
        for flag in self.parts.flags:
            parts.flag(flag)
        self.parts = parts

    def record(self) -> None:
        """Add the turn to its route, in call order (once; later calls do nothing)."""
        if self.recorded:
            return
        self.recorded = True
        state, parts = self.state, self.parts
        if self.status_code is not None and self.status_code >= 400:
            parts.flag(TurnFlag.UPSTREAM_ERROR)
        turn = RolloutTurn(
            index=self.index,
            endpoint=state.public_endpoint,
            request_messages=self.messages,
            response_message=parts.response_message,
            finish_reason=parts.finish_reason,
            prompt_token_ids=parts.prompt_token_ids,
            completion_token_ids=parts.completion_token_ids,
            logprobs=parts.logprobs,
            weight_version=parts.weight_version or state.weight_version,
            status_code=self.status_code,
            latency_sec=time.monotonic() - self.started,
            flags=list(parts.flags),
        )
        bisect.insort(state.route.turns, turn, key=_turn_index)


def _turn_index(turn: RolloutTurn) -> int:
    return turn.index
