"""Classify an exception from a workflow or grader into the protocol's ``err_category``
(the rules are in :func:`categorize_exception`)."""

from __future__ import annotations

import socket
import urllib.error
from typing import Final

from rollout_types import RolloutErrorCategory

from .._errors import ModelEndpointError

__all__ = [
    "HTTP_ERROR_CLASS_NAMES",
    "HTTP_ERROR_STATUS_CLASS_NAMES",
    "HTTP_ERROR_STATUS_CODES",
    "MODEL_ENDPOINT_ERROR_STATUS_CODES",
    "categorize_exception",
]

HTTP_ERROR_CLASS_NAMES: Final = frozenset(
    {
        "SandboxConnectionException",
        "SandboxRateLimitException",
        "PoolStateStoreUnavailableException",
    }
)
"""Class names (anywhere in the MRO) that always mean an infrastructure failure."""

HTTP_ERROR_STATUS_CLASS_NAMES: Final = frozenset({"SandboxApiException", "SandboxAPIError"})
"""Class names that mean an infrastructure failure when ``status_code`` is one of
:data:`HTTP_ERROR_STATUS_CODES`."""

HTTP_ERROR_STATUS_CODES: Final = frozenset({401, 402, 403, 429, 500, 502, 503, 504})
"""Provider status codes that make a :data:`HTTP_ERROR_STATUS_CLASS_NAMES` error an
``http_error``."""

MODEL_ENDPOINT_ERROR_STATUS_CODES: Final = frozenset({401, 402, 403, 404, 408, 429}).union(
    range(500, 600)
)
"""HTTP statuses of a model endpoint that make its error an ``http_error``: 401/403 (the key
is wrong or lacks access), 402 (quota or billing), 404 (a wrong URL or model name), 408 and
429 (overloaded), every 5xx (the endpoint failed)."""

_CONNECT_TIMEOUT_NAMES: Final = frozenset({"aiohttp.ConnectionTimeoutError"})
_TIMEOUT_NAMES: Final = frozenset({"httpx.ReadTimeout", "httpx.WriteTimeout", "APITimeoutError"})
_CONNECTION_FAILURE_NAMES: Final = frozenset(
    {
        "aiohttp.ClientConnectionError",
        "aiohttp.ClientPayloadError",
        "httpx.TransportError",
        "APIConnectionError",
    }
)
_CONNECTION_FAILURE_TYPES: Final = (ConnectionError, socket.gaierror, urllib.error.URLError)


def categorize_exception(exc: BaseException) -> RolloutErrorCategory:
    """Tell which ``err_category`` a failure reports.

    The rules, first match wins (wire-protocol section 5.6, plus the model-endpoint rules that
    are ours; osmosis-ai 0.3.8 reports those exceptions as ``agent_error``):

    ====  ===========================================================  ====================
    rule  exception                                                    ``err_category``
    ====  ===========================================================  ====================
    1     a connect timeout: ``aiohttp.ConnectionTimeoutError``        ``http_error``
    2     ``TimeoutError`` and subclasses (``asyncio.TimeoutError``,   ``timeout``
          aiohttp's read timeouts); ``httpx.ReadTimeout``,
          ``httpx.WriteTimeout``; ``APITimeoutError`` (OpenAI and
          Anthropic SDKs)
    3a    the model endpoint could not be reached or failed:           ``http_error``
          :class:`~rollout_server.ModelEndpointError` (see its
          ``status_code`` rule below); ``ConnectionError`` (refused,
          reset, aborted, broken pipe); ``socket.gaierror`` (DNS);
          ``urllib.error.URLError``;
          ``aiohttp.ClientConnectionError`` and
          ``aiohttp.ClientPayloadError``; ``httpx.TransportError``
          (``ConnectError``, ``ConnectTimeout``, ``PoolTimeout``,
          ``RemoteProtocolError``, ...); ``APIConnectionError``
          (OpenAI and Anthropic SDKs)
    3b    an HTTP status error whose status is in                      ``http_error``
          ``MODEL_ENDPOINT_ERROR_STATUS_CODES``:
          ``aiohttp.ClientResponseError`` (``raise_for_status()``),
          ``httpx.HTTPStatusError``, ``urllib.error.HTTPError``,
          ``APIStatusError`` (OpenAI and Anthropic SDKs)
    4     ``ValueError``, ``TypeError``, ``AssertionError`` (and       ``validation_error``
          ``json.JSONDecodeError``, ``UnicodeError``, pydantic's
          ``ValidationError``)
    5     a class named in ``HTTP_ERROR_CLASS_NAMES`` anywhere         ``http_error``
          in the MRO, or one named in
          ``HTTP_ERROR_STATUS_CLASS_NAMES`` with an integer
          ``status_code`` in ``HTTP_ERROR_STATUS_CODES``
          (sandbox providers, as osmosis-ai)
    6     anything else, including an HTTP status error with another   ``agent_error``
          status (400, 413, 422, ...)
    ====  ===========================================================  ====================

    ``http_error`` means "infrastructure or provider failure" (spec 2.2): callers such as
    ``rollout-eval`` do not score it and run the item again later. A status in
    ``MODEL_ENDPOINT_ERROR_STATUS_CODES`` says the endpoint, or how it is configured, failed
    (a wrong key, an exhausted quota, a wrong URL or model name, rate limiting, a server error):
    the same failure would hit any conversation. Any other 4xx refuses the request the agent
    built (too long a context, a bad tool schema): that is the agent's failure.

    Third-party classes are recognised by name (``aiohttp.X`` and ``httpx.X`` also by the
    top-level module), so neither aiohttp, httpx nor the SDKs are imported or needed: the
    execution core, which categorizes every failure, stays free of HTTP libraries.

    Args:
        exc: What the workflow, the grader or the backend raised.

    Returns:
        The category the result reports.

    .. versionchanged:: 0.2
       Failures to reach the model endpoint, and its 401/402/403/404/408/429/5xx answers,
       are ``http_error`` (they were ``agent_error``, as in osmosis-ai).
    """
    names = _mro_names(exc)
    if names & _CONNECT_TIMEOUT_NAMES:
        return RolloutErrorCategory.HTTP_ERROR
    if isinstance(exc, TimeoutError) or names & _TIMEOUT_NAMES:
        return RolloutErrorCategory.TIMEOUT
    if _is_model_endpoint_failure(exc, names):
        return RolloutErrorCategory.HTTP_ERROR
    if isinstance(exc, ValueError | TypeError | AssertionError):
        return RolloutErrorCategory.VALIDATION_ERROR
    if names & HTTP_ERROR_CLASS_NAMES:
        return RolloutErrorCategory.HTTP_ERROR
    if names & HTTP_ERROR_STATUS_CLASS_NAMES:
        status_code = getattr(exc, "status_code", None)
        if _is_int(status_code) and status_code in HTTP_ERROR_STATUS_CODES:
            return RolloutErrorCategory.HTTP_ERROR
    return RolloutErrorCategory.AGENT_ERROR


def _mro_names(exc: BaseException) -> frozenset[str]:
    """Each class name of the MRO, bare and prefixed with its top-level module."""
    names: set[str] = set()
    for cls in type(exc).__mro__:
        names.add(cls.__name__)
        names.add(f"{cls.__module__.partition('.')[0]}.{cls.__name__}")
    return frozenset(names)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_model_endpoint_failure(exc: BaseException, names: frozenset[str]) -> bool:
    """Rules 3a and 3b: the endpoint was not reached, or answered with an infrastructure status."""
    if isinstance(exc, ModelEndpointError):
        status: object = exc.status_code
        return status is None or (_is_int(status) and status in MODEL_ENDPOINT_ERROR_STATUS_CODES)
    if isinstance(exc, urllib.error.HTTPError):
        status = exc.code
    elif "aiohttp.ClientResponseError" in names:
        status = getattr(exc, "status", None)
    elif "httpx.HTTPStatusError" in names:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    elif "APIStatusError" in names:
        status = getattr(exc, "status_code", None)
    else:
        return isinstance(exc, _CONNECTION_FAILURE_TYPES) or bool(names & _CONNECTION_FAILURE_NAMES)
    return _is_int(status) and status in MODEL_ENDPOINT_ERROR_STATUS_CODES
