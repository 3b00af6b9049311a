"""The error hierarchy of ``rollout_server``."""

from __future__ import annotations

__all__ = ["RolloutServerError", "ServeTargetError", "ServerConfigError"]


class RolloutServerError(Exception):
    """Base class of every error raised by ``rollout_server``."""


class ServerConfigError(RolloutServerError, ValueError):
    """A server construction argument is invalid; the message names it and the fix."""


class ServeTargetError(RolloutServerError, ValueError):
    """``rollout-server serve MODULE:ATTR`` could not turn its target into a rollout app."""
