"""The 422 errors the routes build themselves, beyond what the converter reports.

Each is a :class:`~rollout_types.WireValidationError` whose entries have the shape of
osmosis-ai's (pydantic's) 422 ``detail``: a missing or empty request header, a body nested
deeper than the interpreter can walk, a ``rollout_id`` no URL can carry. Only the server
builds these, so they live here rather than in ``rollout_types``.
"""

from __future__ import annotations

from typing import Any

from rollout_types import REDACTED, WireValidationError

__all__ = ["header_error", "too_deep_error", "unencodable_id_error"]


def header_error(name: str, value: str | None) -> WireValidationError:
    """Build the 422 for a missing (``None``) or empty required request header ``name``."""
    if value is None:
        entry: dict[str, Any] = {
            "type": "missing",
            "loc": ["header", name],
            "msg": "Field required",
            "input": None,
        }
    else:
        entry = {
            "type": "string_too_short",
            "loc": ["header", name],
            "msg": "String should have at least 1 character",
            "input": REDACTED if value else value,
            "ctx": {"min_length": 1},
        }
    return WireValidationError([entry])


def too_deep_error() -> WireValidationError:
    """Build the 422 for a JSON body nested deeper than the interpreter can decode or walk
    (refused like any undecodable body)."""
    return WireValidationError(
        [
            {
                "type": "json_invalid",
                "loc": ["body", 0],
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": "JSON document nested too deeply"},
            }
        ]
    )


def unencodable_id_error(rollout_id: str) -> WireValidationError:
    """Build the 422 for a ``rollout_id`` holding a lone surrogate (a ``\\ud800``-``\\udfff``
    escape in the request), which no URL can carry."""
    return WireValidationError(
        [
            {
                "type": "value_error",
                "loc": ["body", "rollout_id"],
                "msg": (
                    "Value error, rollout_id must be valid Unicode: it holds a lone surrogate "
                    "(a \\ud800-\\udfff escape), which no URL can carry"
                ),
                "input": rollout_id,
                "ctx": {"error": {}},
            }
        ]
    )
