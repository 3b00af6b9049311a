"""What one work item's ending means: the journal ``outcome`` of a result or a failure.

=========================================================  ===============================
what happened                                              outcome
=========================================================  ===============================
``success`` (``remove_sample`` false)                      ``success``, with the reward
``success`` with ``remove_sample``                         ``skipped`` (not scored)
``success`` without a reward                               ``failed`` (``no_reward``)
``failure`` with ``agent_error``, ``timeout``,             ``failed`` (scored as reward 0)
``validation_error`` or no category
``failure`` with ``lease_expired``, ``internal_error``,    ``infra_failure`` (never scored;
``http_error`` or a category this client does not know     pending again on resume)
a status this client does not know                         ``infra_failure``
                                                           (``protocol_error``)
transport error, protocol error, admission timeout,        ``infra_failure`` with category
item deadline overrun, anything else raised                ``transport_error``,
                                                           ``protocol_error``,
                                                           ``admission_timeout``,
                                                           ``deadline_exceeded``,
                                                           ``client_error``
``cancelled``                                              not recorded: the item stays
                                                           pending
``503`` "rollout server is shutting down" on admission     not recorded: the item stays
(several servers: none admits, and at least one of them    pending; no new rollouts start,
is shutting down)                                          the in-flight ones are collected
                                                           (:func:`server_draining_reason`)
another protocol version, the key refused (401)            not recorded: the run stops
=========================================================  ===============================

``success``, ``failed`` and ``skipped`` are final: the item is done and is not run again on
resume. ``infra_failure`` is an attempt: the item stays pending, is run again on resume
with a fresh rollout id, and counts towards ``--max-consecutive-infra-failures``.

A success *passes* when its reward is at least the run's pass threshold (:func:`passes`).
"""

from __future__ import annotations

import dataclasses
from typing import Final

import aiohttp

from rollout_types import RolloutResultResponse, RolloutStatus

from .._admission import SHUTTING_DOWN_DETAIL
from .._errors import (
    RolloutAdmissionTimeoutError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
    RolloutServersUnavailableError,
)
from .._infra import SCORED_FAILURE_CATEGORIES

__all__ = [
    "Classified",
    "classify_exception",
    "classify_result",
    "deadline_exceeded",
    "passes",
    "run_stopping_reason",
    "server_draining_reason",
]

_SCORED_FAILURE_CATEGORIES: Final = SCORED_FAILURE_CATEGORIES
"""The client's one list of scored failure categories (``_infra.py``, shared with groups)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Classified:
    """How one terminal result is recorded: ``outcome`` (None: not recorded) and reward."""

    outcome: str | None
    reward: float | None
    err_category: str | None
    err_message: str | None


def passes(outcome: str | None, reward: float | None, pass_threshold: float) -> bool:
    """Whether an outcome passes: a ``success`` whose reward is at least the threshold."""
    return outcome == "success" and (reward or 0.0) >= pass_threshold


def classify_result(result: RolloutResultResponse) -> Classified:
    """Map a terminal result to its journal outcome (the table in the module docstring)."""
    category = None if result.err_category is None else str(result.err_category)
    if result.status == RolloutStatus.CANCELLED:
        return Classified(outcome=None, reward=None, err_category=category, err_message=None)
    if result.status == RolloutStatus.SUCCESS:
        sample = result.sample
        if sample is not None and sample.remove_sample:
            return Classified(outcome="skipped", reward=None, err_category=None, err_message=None)
        if sample is None or sample.reward is None:
            return Classified(
                outcome="failed",
                reward=None,
                err_category="no_reward",
                err_message="the server reported success without a reward (is grading on?)",
            )
        return Classified(
            outcome="success", reward=float(sample.reward), err_category=None, err_message=None
        )
    if result.status == RolloutStatus.FAILURE:
        scored = result.err_category in _SCORED_FAILURE_CATEGORIES
        return Classified(
            outcome="failed" if scored else "infra_failure",
            reward=None,
            err_category=category,
            err_message=result.err_message,
        )
    return Classified(
        outcome="infra_failure",
        reward=None,
        err_category="protocol_error",
        err_message=f"the rollout ended with the unknown status {str(result.status)!r}",
    )


def run_stopping_reason(exc: Exception, *, phase: str) -> str | None:
    """Why ``exc`` stops the whole run (no rollout can succeed), or None when it does not.

    Args:
        exc: What admitting or awaiting one rollout raised.
        phase: ``admission`` or ``result``.
    """
    if isinstance(exc, RolloutProtocolVersionError):
        return f"the rollout server speaks another protocol version: {exc}"
    if isinstance(exc, RolloutProtocolError) and exc.status_code == 401:
        return (
            f"the rollout server refused the API key (401) during {phase}; pass the right key "
            "with --server-api-key-env"
        )
    return None


def server_draining_reason(exc: Exception, *, phase: str) -> str | None:
    """Why the run stops admitting but keeps collecting, or None when ``exc`` is no such sign.

    The sign is a ``503`` answer to ``POST /rollout`` whose ``detail`` is
    :data:`~rollout_client._admission.SHUTTING_DOWN_DETAIL` (the client puts the detail in
    the message of the :class:`~rollout_client.RolloutProtocolError`): the server admits
    nothing more but still serves the results of the rollouts it is draining. A ``503``
    from a gateway (another body) is an ordinary infrastructure failure.

    With several servers the pool handles each ``503`` itself (that server leaves the
    rotation) and raises :class:`~rollout_client.RolloutServersUnavailableError` once no
    server can take a rollout. That drains the run when at least one of them is shutting
    down: the others failed too (this admission, or the probe the pool made before it
    raised), so no rollout could start, and the ones in flight on the servers shutting down
    still finish. When none is shutting down it is an ordinary infrastructure failure.

    Args:
        exc: What admitting or awaiting one rollout raised.
        phase: ``admission`` or ``result``.
    """
    if phase != "admission":
        return None
    if isinstance(exc, RolloutServersUnavailableError) and exc.shutting_down:
        others = [
            f"{url}: {why}" for url, why in exc.reasons.items() if url not in exc.shutting_down
        ]
        if not others:
            return "every rollout server is shutting down (none admits a new rollout)"
        return (
            f"no rollout server admits new rollouts ({len(exc.shutting_down)} shutting down; "
            + "; ".join(others)
            + ")"
        )
    if (
        isinstance(exc, RolloutProtocolError)
        and exc.status_code == 503
        and str(exc).endswith(f": {SHUTTING_DOWN_DETAIL}")
    ):
        return "the rollout server is shutting down (it answered 503 to a new rollout)"
    return None


def classify_exception(exc: Exception, *, phase: str) -> Classified:
    """The ``infra_failure`` of a rollout whose admission or result raised ``exc``.

    Args:
        exc: The exception (one :func:`run_stopping_reason` did not claim).
        phase: ``admission`` or ``result``; it prefixes the message.
    """
    if isinstance(exc, RolloutAdmissionTimeoutError):
        category = "admission_timeout"
    elif isinstance(exc, RolloutProtocolError):
        category = "protocol_error"
    elif isinstance(exc, aiohttp.ClientError | OSError | TimeoutError):
        category = "transport_error"
    else:
        category = "client_error"
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return Classified(
        outcome="infra_failure",
        reward=None,
        err_category=category,
        err_message=f"{phase}: {message}",
    )


def deadline_exceeded(deadline_sec: float) -> Classified:
    """The ``infra_failure`` of a rollout without a result ``deadline_sec`` after admission."""
    return Classified(
        outcome="infra_failure",
        reward=None,
        err_category="deadline_exceeded",
        err_message=(
            f"no result within {deadline_sec:g} s of admission; the rollout was "
            "cancelled on the server (raise --item-deadline-sec if it needs longer)"
        ),
    )
