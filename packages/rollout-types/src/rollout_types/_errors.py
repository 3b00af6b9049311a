"""The error hierarchy of ``rollout_types``."""

from __future__ import annotations

from typing import Any

__all__ = ["FieldValueError", "RolloutTypesError", "WireValidationError"]


class RolloutTypesError(Exception):
    """Base class of every error raised by ``rollout_types``."""


class FieldValueError(RolloutTypesError, ValueError):
    """A model invariant failed for one field; ``field`` names it, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class WireValidationError(RolloutTypesError, ValueError):
    """A wire document did not validate; ``errors`` holds the 422 ``detail`` entries.

    Each entry is ``{"type", "loc", "msg", "input"[, "ctx"]}`` with ``loc`` starting at
    ``"body"`` or ``"header"`` and secrets already redacted from ``input``.
    """

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self.errors = errors
        summary = "; ".join(
            f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in errors
        )
        super().__init__(summary or "invalid document")

    @property
    def body(self) -> dict[str, Any]:
        """The 422 response body, ``{"detail": [...]}``."""
        return {"detail": self.errors}
