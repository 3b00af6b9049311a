"""The chat stand-in's toy tokenizer and the token fields it returns (see ``server.py``).

Each word, punctuation mark or run of white space of a text is hashed to an id below
:data:`VOCAB_SIZE` (:func:`tokenize`); the prompt is a fixed rendering of the chat
(:func:`render_prompt`); a completion is cut into the pieces a stream sends
(:func:`deltas`), whose tokens are the completion's, and each token's logprob is a pure
function of the seed, the prompt and the position (:class:`Tokens`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any, Final

__all__ = [
    "TOKEN",
    "VOCAB_SIZE",
    "Tokens",
    "delta_tokens",
    "deltas",
    "render_prompt",
    "text_of",
    "token_id",
    "tokenize",
    "tokens_asked",
    "unit",
]

VOCAB_SIZE: Final = 32000
"""Token ids of the toy tokenizer are in ``[100, VOCAB_SIZE)`` (ids below 100 are unused)."""

TOKEN: Final = re.compile(r"\w+|[^\w\s]|\s+")


def token_id(piece: str) -> int:
    digest = hashlib.sha256(piece.encode()).digest()
    return 100 + int.from_bytes(digest[:4], "big") % (VOCAB_SIZE - 100)


def tokenize(text: str) -> list[int]:
    """The toy tokenizer: each word, punctuation mark or run of white space, hashed to an id."""
    return [token_id(piece) for piece in TOKEN.findall(text)]


def render_prompt(body: dict[str, Any]) -> str:
    """The toy chat template: each message as ``<|role|>content[tool calls][call id]<|end|>``,
    the tool names, then ``<|assistant|>`` (the prompt whose tokens ``prompt_token_ids`` are).
    """
    parts = []
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        text = f"<|{message.get('role')}|>{text_of(message.get('content'))}"
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


def text_of(content: Any) -> str:
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
class Tokens:
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
            value = -round(unit(self.seed, "logprob", self.digest, position, token) * 4.0, 6)
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


def tokens_asked(seed: int, body: dict[str, Any]) -> Tokens | None:
    """The token fields ``body`` asks for (None: neither ids nor logprobs), with ``seed``
    (the stand-in's) for the logprobs."""
    ids = body.get("return_token_ids") is True
    logprobs = body.get("logprobs") is True
    if not (ids or logprobs):
        return None
    prompt = render_prompt(body)
    return Tokens(
        prompt_token_ids=tokenize(prompt) if ids else None,
        logprobs=logprobs,
        as_ids=body.get("return_tokens_as_token_ids") is True,
        seed=seed,
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


def delta_tokens(
    tokens: Tokens, delta: dict[str, Any], start: int
) -> tuple[list[int], list[dict[str, Any]]]:
    pieces = TOKEN.findall(_delta_text(delta))
    ids = [token_id(piece) for piece in pieces]
    return ids, tokens.entries(ids, pieces, start) if tokens.logprobs else []


def unit(*parts: object) -> float:
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _pieces(text: str, size: int = 8) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
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
