"""The server's one JSON module: the bytes of every body it sends, from the one converter.

Everything the server answers is a strict-JSON document encoded here with
:func:`rollout_types.dumps` (the converter's unstructuring): results, health, errors. Two
are kept in a cheaper form, because each rollout needs them:

* a result is encoded once, when it is published, and kept as bytes (a poll only copies
  them out; bytes are also far smaller than the model they came from);
* an in-progress result (``{"rollout_id", "status", every other field null}``) is encoded
  on demand, only for a poll that answers a status, from a template the converter produced
  for that status at import: the rollout id is spliced into it, which costs about 1 µs
  where unstructuring the model costs about 12 µs.

Nothing here knows HTTP; :mod:`rollout_server.http._responses` wraps these bytes in responses.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from rollout_types import (
    RolloutErrorCategory,
    RolloutResultResponse,
    RolloutSample,
    RolloutStatus,
    RolloutTurn,
    dumps,
)

__all__ = [
    "LONE_SURROGATE",
    "detail_body",
    "encode",
    "encode_json",
    "progress_body",
    "result_body",
]

LONE_SURROGATE: Final = re.compile("[\ud800-\udfff]")
"""A lone surrogate: a code point with no UTF-8 form (only a ``\\uXXXX`` escape makes one)."""


def _escape_surrogate(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def encode_json(text: str) -> bytes:
    """UTF-8 bytes of an encoded JSON document.

    A lone surrogate (which only a JSON string escape such as ``"\\ud800"`` in a request
    can produce) has no UTF-8 form: it is written back as the same ``\\uXXXX`` escape, so
    the body stays valid JSON that decodes to the same value, instead of failing.
    """
    try:
        return text.encode()
    except UnicodeEncodeError:
        return LONE_SURROGATE.sub(_escape_surrogate, text).encode()


def encode(document: Any) -> bytes:
    """UTF-8 bytes of ``document`` (a wire model or plain JSON data) as strict, compact JSON.

    Raises:
        ValueError: If the document holds a non-finite number.
        TypeError: If it holds a value JSON cannot encode.
    """
    return encode_json(dumps(document))


def detail_body(detail: Any) -> bytes:
    """The error body ``{"detail": detail}`` (a string, or a 422 list of entries)."""
    return encode({"detail": detail})


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "A result is encoded
#   once, at publication ..."
def result_body(
    *,
    rollout_id: str,
    status: RolloutStatus,
    sample: RolloutSample | None,
    err_message: str | None,
    err_category: RolloutErrorCategory | None,
    turns: list[RolloutTurn] | None = None,
) -> bytes:
    """The result document of a published rollout (spec section 4.6); ``turns`` only for
    a caller that asked for them (absent from the document when None)."""
    return encode(
        RolloutResultResponse(
            rollout_id=rollout_id,
            status=status,
            sample=sample,
            err_message=err_message,
            err_category=err_category,
            turns=turns,
        )
    )


_encode_string: Final = json.JSONEncoder(ensure_ascii=False).encode
"""A JSON string as :func:`rollout_types.dumps` writes it (the same escaping)."""

_ID_MARKER: Final = "\x00rollout_id\x00"
"""Stands for the rollout id while the templates are made (no field name or status holds
it, so it occurs once in each template document)."""


def _progress_templates() -> dict[RolloutStatus, tuple[str, str]]:
    """For each status, the converter's in-progress document split around the rollout id."""
    marker = _encode_string(_ID_MARKER)
    templates: dict[RolloutStatus, tuple[str, str]] = {}
    for status in RolloutStatus:
        document = dumps(RolloutResultResponse(rollout_id=_ID_MARKER, status=status))
        head, found, tail = document.partition(marker)
        if not found or marker in tail:  # pragma: no cover - a converter change would do it
            raise AssertionError(f"cannot make the progress template from {document!r}")
        templates[status] = (head, tail)
    return templates


_PROGRESS_TEMPLATES: Final = _progress_templates()


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "A result is encoded
#   once, at publication ..."
def progress_body(rollout_id: str, status: RolloutStatus) -> bytes:
    """The result document of a rollout in progress: its id and status, every other field
    null; the same bytes as :func:`encode` of that :class:`~rollout_types.RolloutResultResponse`.
    """
    head, tail = _PROGRESS_TEMPLATES[status]
    return encode_json(head + _encode_string(rollout_id) + tail)
