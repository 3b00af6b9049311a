"""The error hierarchy of ``rollout_server``, and the error agent code raises for its model."""

from __future__ import annotations

__all__ = ["ModelEndpointError", "RolloutServerError", "ServeTargetError", "ServerConfigError"]


class RolloutServerError(Exception):
    """Base class of every error raised by ``rollout_server``."""


class ServerConfigError(RolloutServerError, ValueError):
    """A server construction argument is invalid; the message names it and the fix."""


class ServeTargetError(RolloutServerError, ValueError):
    """``rollout-server serve MODULE:ATTR`` could not turn its target into a rollout app."""


class ModelEndpointError(Exception):
    """The policy model's endpoint failed; agent code raises it (or a subclass).

    The server never raises it: a workflow or grader raises it when calling the model (the
    ``chat_completions_url`` of the rollout) fails, so that the failure is reported as what
    it is. :func:`~rollout_server.categorize_exception` makes it ``http_error`` (an
    infrastructure failure that callers such as ``rollout-eval`` do not score) when
    ``status_code`` is None or in ``MODEL_ENDPOINT_ERROR_STATUS_CODES`` (401, 402, 403, 404,
    408, 429, 5xx), and ``agent_error`` for any other status (the endpoint refused the
    request the agent built: 400, 413, 422, ...).

    Args:
        message: What failed, e.g. ``"POST http://h/v1/chat/completions returned 503: busy"``.
        status_code: The endpoint's HTTP status, or None when it gave no usable HTTP answer
            (unreachable, connection dropped, a body that is not a chat completion).

    .. versionadded:: 0.2
    """

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
