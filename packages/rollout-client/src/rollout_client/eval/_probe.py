"""What a run asks before it starts: the models the chat endpoint lists, and whether the
rollout server is usable and how many rollouts it takes at once."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Final

import aiohttp

from .._errors import RolloutProtocolError, RolloutProtocolVersionError
from ._client_seam import ClientFactory, RunClient
from ._errors import ServerUnavailableError
from ._options import EvalOptions

__all__ = [
    "CHAT_MODELS_TIMEOUT_SEC",
    "DEFAULT_CONCURRENCY_WITHOUT_LIMIT",
    "HEALTH_TIMEOUT_SEC",
    "capacity_from_health",
    "choose_concurrency",
    "fetch_chat_models",
    "probe_server",
]

HEALTH_TIMEOUT_SEC: Final = 10.0
"""Bound on the initial ``/health`` check."""

CHAT_MODELS_TIMEOUT_SEC: Final = 5.0
"""Bound on ``GET {chat_url}/models``."""

DEFAULT_CONCURRENCY_WITHOUT_LIMIT: Final = 32
"""Concurrency when the server reports no limit and ``--concurrency`` is not given."""


async def fetch_chat_models(chat_url: str, api_key: str | None) -> tuple[str, ...] | None:
    """The sorted model ids ``GET {chat_url}/models`` lists, or None when it cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=CHAT_MODELS_TIMEOUT_SEC)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(
                chat_url.rstrip("/") + "/models", headers=headers, allow_redirects=False
            ) as response,
        ):
            if response.status != 200:
                return None
            data = await response.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    try:
        return tuple(sorted(str(entry["id"]) for entry in data["data"]))
    except (KeyError, TypeError):
        return None


def capacity_from_health(health: Mapping[str, Any]) -> int | None:
    """The concurrency capacity a ``/health`` body reports, or None when it reports none.

    Reads ``max_queue_depth`` (HarborBackend-style) or ``concurrency.max_concurrent``
    (LocalBackend), as ``osmosis eval run`` does.
    """
    for value in (
        health.get("max_queue_depth"),
        (health.get("concurrency") or {}).get("max_concurrent")
        if isinstance(health.get("concurrency"), dict)
        else None,
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


async def probe_server(factory: ClientFactory, options: EvalOptions) -> dict[str, Any]:
    """Fetch the server's ``/health`` with a client of its own, closed afterwards.

    Returns:
        The health payload.

    Raises:
        ServerUnavailableError: The server is unreachable, refuses the key, speaks another
            protocol or answers badly, with what to do about it.
    """
    probe = factory(url=options.server_url, api_key=options.server_api_key)
    try:
        return await _check_server(probe, options)
    finally:
        await probe.aclose()


async def _check_server(client: RunClient, options: EvalOptions) -> dict[str, Any]:
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_SEC):
            return await client.health()
    except RolloutProtocolVersionError as exc:
        raise ServerUnavailableError(str(exc)) from None
    except RolloutProtocolError as exc:
        if exc.status_code == 401:
            raise ServerUnavailableError(
                f"the rollout server at {options.server_url} requires an API key (401); pass "
                "--server-api-key-env NAME with the key in environment variable NAME"
            ) from None
        raise ServerUnavailableError(
            f"the rollout server at {options.server_url} answered GET /health badly: {exc}"
        ) from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise ServerUnavailableError(
            f"cannot reach the rollout server at {options.server_url} ({type(exc).__name__}: "
            f"{exc}); start it (rollout-server serve MODULE:ATTR) or fix --server"
        ) from None


def choose_concurrency(
    options: EvalOptions, health: Mapping[str, Any], *, pending: int
) -> tuple[int, str | None]:
    """The rollouts to keep in flight: ``--concurrency``, else the server's capacity, else 32;
    never more than ``pending``.

    Returns:
        The concurrency, and a note for the user when the server reports no limit.
    """
    capacity = capacity_from_health(health)
    note = None
    if options.concurrency is not None:
        concurrency = options.concurrency
    elif capacity is not None:
        concurrency = capacity
    else:
        concurrency = DEFAULT_CONCURRENCY_WITHOUT_LIMIT
        note = (
            "rollout-eval: the server reports no concurrency limit; running "
            f"{concurrency} at a time (set --concurrency to change)"
        )
    return min(concurrency, pending), note
