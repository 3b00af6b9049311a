"""Classify an exception from a workflow or grader into the protocol's ``err_category``."""

from __future__ import annotations

from typing import Final

from rollout_types import RolloutErrorCategory

__all__ = [
    "HTTP_ERROR_CLASS_NAMES",
    "HTTP_ERROR_STATUS_CLASS_NAMES",
    "HTTP_ERROR_STATUS_CODES",
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


def categorize_exception(exc: BaseException) -> RolloutErrorCategory:
    """Tell which ``err_category`` a failure reports (wire-protocol section 5.6).

    Rules, in order:

    1. ``TimeoutError`` and subclasses (``asyncio.TimeoutError`` too): ``timeout``.
    2. ``ValueError``, ``TypeError``, ``AssertionError`` (and subclasses such as
       ``json.JSONDecodeError`` or ``UnicodeError``): ``validation_error``.
    3. A class named in :data:`HTTP_ERROR_CLASS_NAMES` anywhere in the MRO, or one named in
       :data:`HTTP_ERROR_STATUS_CLASS_NAMES` with an integer ``status_code`` attribute in
       :data:`HTTP_ERROR_STATUS_CODES`: ``http_error``. Names, not types, so the providers'
       packages need not be installed.
    4. Anything else: ``agent_error``.
    """
    if isinstance(exc, TimeoutError):
        return RolloutErrorCategory.TIMEOUT
    if isinstance(exc, ValueError | TypeError | AssertionError):
        return RolloutErrorCategory.VALIDATION_ERROR
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & HTTP_ERROR_CLASS_NAMES:
        return RolloutErrorCategory.HTTP_ERROR
    if names & HTTP_ERROR_STATUS_CLASS_NAMES:
        status_code = getattr(exc, "status_code", None)
        if (
            isinstance(status_code, int)
            and not isinstance(status_code, bool)
            and status_code in HTTP_ERROR_STATUS_CODES
        ):
            return RolloutErrorCategory.HTTP_ERROR
    return RolloutErrorCategory.AGENT_ERROR
