"""What a run does while its rollout server restarts (issue 28: a restart loses nothing).

A ``rollout-server serve`` on a durable state file that is killed and started again on the
same port keeps every admitted rollout: a poll with the original lease token collects the
stored result, and a rollout that was in flight when the process died is published as
``failure`` / ``internal_error`` with a message naming the process that ended
(:data:`RESTART_MESSAGE`). A run rides out such a restart of up to
:data:`OUTAGE_BUDGET_SEC` seconds:

* result polls retry a refused or dropped connection on :data:`OUTAGE_RETRY`'s transport
  schedule (the default client factory's; the lease token is kept, and every retry must
  still fit the polling lease), so a result that survived is collected and scored;
* an admission refused or cut off by the outage is tried again after
  :data:`ADMISSION_OUTAGE_DELAYS_SEC`, with a fresh rollout id (an admission cut off may
  have been stored; the server fails that orphan when its lease lapses);
* the rollouts one restart failed are infrastructure failures (unscored, pending, run again
  on resume) that count **once** towards ``--max-consecutive-infra-failures``
  (:func:`restart_key`): one restart with 32 rollouts in flight is one fault, not 32.
"""

from __future__ import annotations

import re
from typing import Final

import aiohttp

from .._errors import RolloutServersUnavailableError
from .._retry import RetrySettings

__all__ = [
    "ADMISSION_OUTAGE_DELAYS_SEC",
    "OUTAGE_BUDGET_SEC",
    "OUTAGE_RETRY",
    "RESTART_MESSAGE",
    "is_outage",
    "restart_key",
]

ADMISSION_OUTAGE_DELAYS_SEC: Final = (0.1, 0.5, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0)
"""Pauses before each new admission attempt after a refused or dropped connection, seconds
(16.6 s in all, the protocol's 0.1 and 0.5 s first); then the item is recorded as an
infrastructure failure."""

OUTAGE_BUDGET_SEC: Final = sum(ADMISSION_OUTAGE_DELAYS_SEC)
"""How long a server may be unreachable before rollouts fail for it, seconds (16.6)."""

OUTAGE_RETRY: Final = RetrySettings(transport_delays_sec=ADMISSION_OUTAGE_DELAYS_SEC)
"""The retry schedules of the run's default client: the protocol's (osmosis-ai 0.3.8's)
except that a result poll retries transport failures on :data:`ADMISSION_OUTAGE_DELAYS_SEC`
(instead of 0.1 and 0.5 s), so a poll outlasts a server restart of a few seconds."""

RESTART_MESSAGE: Final = re.compile(
    r"the server process (?P<process_id>\S+) ended before the rollout finished"
)
"""The ``err_message`` of a rollout a restarted server failed (rollout-server's recovery)."""


def restart_key(err_category: str | None, err_message: str | None) -> str | None:
    """The ``process_id`` of the server process whose end failed this rollout, or None.

    Args:
        err_category: The recorded error category (only ``internal_error`` qualifies).
        err_message: The recorded message.
    """
    if err_category != "internal_error" or not err_message:
        return None
    match = RESTART_MESSAGE.search(err_message)
    return None if match is None else match.group("process_id")


def is_outage(exc: BaseException) -> bool:
    """Whether an admission failed because no server could be reached (try again later).

    True for a refused, reset or dropped connection (:class:`aiohttp.ClientConnectionError`,
    :class:`ConnectionError`) and, with several servers, for
    :class:`~rollout_client.RolloutServersUnavailableError` when none of them is shutting
    down (a server shutting down drains the run instead). Timeouts are not outages: the
    admission deadline already bounded them.
    """
    if isinstance(exc, RolloutServersUnavailableError):
        return not exc.shutting_down
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return False
    return isinstance(exc, aiohttp.ClientConnectionError | ConnectionError)
