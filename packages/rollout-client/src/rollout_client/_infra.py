"""Which rollout failures are the infrastructure's, not the policy's: they never score.

One classification serves :meth:`~rollout_client.RolloutClient.run_group` (whose ``mask``
and ``retry`` policies act on them) and ``rollout-eval`` (which records them as
``infra_failure``, never as reward 0):

==========================================================  ==============================
what happened                                               infrastructure?
==========================================================  ==============================
``failure`` with ``agent_error``, ``timeout``,              no: the policy's (scored)
``validation_error`` or no category
``failure`` with ``http_error`` (the model endpoint or a    yes
provider failed), ``lease_expired``, ``internal_error``
(a server restart) or a category this client does not know
``cancelled``                                               yes (never scored)
a status this client does not know                          yes
transport error, admission timeout, no server can take it,  yes
a protocol error other than the ones below
another protocol version, the key refused (401), a          no: raised to the caller (no
duplicate id (409), a request the server refused (422)      rollout of this kind can run)
==========================================================  ==============================
"""

from __future__ import annotations

from typing import Final

import aiohttp

from rollout_types import RolloutErrorCategory, RolloutResultResponse, RolloutStatus

from ._errors import (
    RolloutAdmissionTimeoutError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
    RolloutServersUnavailableError,
)

__all__ = [
    "CALLER_STATUSES",
    "SCORED_FAILURE_CATEGORIES",
    "infrastructure_exception",
    "infrastructure_result",
]

SCORED_FAILURE_CATEGORIES: Final[frozenset[RolloutErrorCategory | None]] = frozenset(
    {
        None,
        RolloutErrorCategory.AGENT_ERROR,
        RolloutErrorCategory.TIMEOUT,
        RolloutErrorCategory.VALIDATION_ERROR,
    }
)
"""The ``err_category`` values of a ``failure`` that is the policy's own (scored as 0)."""

CALLER_STATUSES: Final = frozenset({400, 401, 403, 409, 422})
"""Statuses of a :class:`~rollout_client.RolloutProtocolError` that say the request or the
caller is wrong (not the infrastructure): raised, never masked or retried."""


def infrastructure_result(result: RolloutResultResponse) -> str | None:
    """Why a terminal result is an infrastructure failure, or None when it is not.

    Returns:
        ``"<category>: <message>"`` for a ``failure`` outside
        :data:`SCORED_FAILURE_CATEGORIES`, ``"cancelled"`` for a cancelled rollout, and
        ``"unknown status <status>"`` for a status this client does not know; None for a
        success and for a scored failure.
    """
    if result.status == RolloutStatus.SUCCESS:
        return None
    if result.status == RolloutStatus.CANCELLED:
        return "cancelled" + (f": {result.err_message}" if result.err_message else "")
    if result.status == RolloutStatus.FAILURE:
        if result.err_category in SCORED_FAILURE_CATEGORIES:
            return None
        return f"{result.err_category}: {result.err_message or '(no message)'}"
    return f"unknown status {str(result.status)!r}"


def infrastructure_exception(exc: BaseException) -> str | None:
    """Why admitting or polling a rollout failed for an infrastructure reason, or None when
    ``exc`` is the caller's problem (see the module docstring) or not an expected failure.

    Returns:
        ``"<kind>: <ExceptionType>: <message>"`` with kind ``admission_timeout``,
        ``servers_unavailable``, ``protocol_error`` or ``transport_error``.
    """
    if isinstance(exc, RolloutProtocolVersionError):
        return None
    if isinstance(exc, RolloutAdmissionTimeoutError):
        kind = "admission_timeout"
    elif isinstance(exc, RolloutServersUnavailableError):
        kind = "servers_unavailable"
    elif isinstance(exc, RolloutProtocolError):
        if exc.status_code in CALLER_STATUSES:
            return None
        kind = "protocol_error"
    elif isinstance(exc, aiohttp.ClientError | OSError | TimeoutError):
        kind = "transport_error"
    else:
        return None
    return f"{kind}: {type(exc).__name__}: {exc}" if str(exc) else f"{kind}: {type(exc).__name__}"
