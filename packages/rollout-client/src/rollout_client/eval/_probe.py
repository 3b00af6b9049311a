"""What a run asks before it starts: the models the chat endpoint lists, and whether each
rollout server is usable and how many rollouts the servers take at once."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

import aiohttp

from .._errors import RolloutProtocolError, RolloutProtocolVersionError
from ._client_seam import ClientFactory, RunClient
from ._errors import ServerUnavailableError
from ._keys import describe_key
from ._options import EvalOptions

__all__ = [
    "CHAT_MODELS_TIMEOUT_SEC",
    "DEFAULT_CONCURRENCY_WITHOUT_LIMIT",
    "HEALTH_TIMEOUT_SEC",
    "ChatModels",
    "capacity_from_health",
    "choose_concurrency",
    "fetch_chat_models",
    "probe_servers",
]

HEALTH_TIMEOUT_SEC: Final = 10.0
"""Bound on the initial ``/health`` check."""

CHAT_MODELS_TIMEOUT_SEC: Final = 5.0
"""Bound on ``GET {chat_url}/models``."""

DEFAULT_CONCURRENCY_WITHOUT_LIMIT: Final = 32
"""Concurrency when the server reports no limit and ``--concurrency`` is not given."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChatModels:
    """What ``GET {chat_url}/models`` said.

    Attributes:
        models: The sorted model ids it lists, or None when it listed none or could not be
            read.
        status: The HTTP status when it answered other than 200 (401 and 403: the key was
            refused), else None.
    """

    models: tuple[str, ...] | None
    status: int | None = None

    def warning(self, chat_url: str, api_key: str | None) -> str | None:
        """The warning a run prints before it starts, or None when models were listed."""
        if self.models is not None:
            return None
        url = f"GET {chat_url.rstrip('/')}/models"
        if self.status in (401, 403):
            if api_key:
                return (
                    f"{url} answered {self.status}: the model endpoint rejected "
                    f"{describe_key(api_key, 'llm_api_key')}; every rollout will fail with it: "
                    "check the key (or its variable, --llm-api-key-env)"
                )
            return (
                f"{url} answered {self.status}: the model endpoint needs an API key and none was "
                "given; pass --llm-api-key-env NAME with the key in environment variable NAME"
            )
        answered = f" (it answered {self.status})" if self.status is not None else ""
        return (
            f"{url} did not list any model{answered}; if the rollout server cannot reach "
            "--chat-url either, every rollout will fail"
        )


async def fetch_chat_models(chat_url: str, api_key: str | None) -> ChatModels:
    """Ask ``GET {chat_url}/models`` (bounded by :data:`CHAT_MODELS_TIMEOUT_SEC`) which
    models it serves; never raises for what the endpoint does."""
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
                return ChatModels(models=None, status=response.status)
            data = await response.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return ChatModels(models=None)
    try:
        return ChatModels(models=tuple(sorted(str(entry["id"]) for entry in data["data"])))
    except (KeyError, TypeError):
        return ChatModels(models=None)


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


async def probe_servers(factory: ClientFactory, options: EvalOptions) -> list[dict[str, Any]]:
    """Fetch each server's ``/health``, one after the other, each with a client of its own,
    closed afterwards.

    Returns:
        The health payloads, in the order of ``options.server_urls``.

    Raises:
        ServerUnavailableError: A server is unreachable, refuses the key, speaks another
            protocol or answers badly, with its URL and what to do about it.
    """
    healths = []
    for url in options.server_urls:
        probe = factory(url=url, api_key=options.server_api_key)
        try:
            healths.append(await _check_server(probe, url, options.server_api_key))
        finally:
            await probe.aclose()
    return healths


async def _check_server(client: RunClient, url: str, api_key: str | None) -> dict[str, Any]:
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_SEC):
            return await client.health()
    except RolloutProtocolVersionError as exc:
        raise ServerUnavailableError(str(exc)) from None
    except RolloutProtocolError as exc:
        if exc.status_code in (401, 403) and api_key:
            raise ServerUnavailableError(
                f"the rollout server at {url} rejected {describe_key(api_key, 'server_api_key')} "
                f"({exc.status_code}); check the key, or name the variable that holds the right "
                "one with --server-api-key-env"
            ) from None
        if exc.status_code == 401:
            raise ServerUnavailableError(
                f"the rollout server at {url} requires an API key (401); pass "
                "--server-api-key-env NAME with the key in environment variable NAME"
            ) from None
        raise ServerUnavailableError(
            f"the rollout server at {url} answered GET /health badly: {exc}"
        ) from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise ServerUnavailableError(
            f"cannot reach the rollout server at {url} ({type(exc).__name__}: "
            f"{exc}); start it (rollout-server serve MODULE:ATTR) or fix --server"
        ) from None


def choose_concurrency(
    options: EvalOptions, healths: Sequence[Mapping[str, Any]], *, pending: int
) -> tuple[int, str | None]:
    """The rollouts to keep in flight: ``--concurrency``, else the servers' capacities added
    up (when every server reports one), else 32; never more than ``pending``.

    Args:
        options: The run's options.
        healths: The ``/health`` payload of each server.
        pending: The work items still to run.

    Returns:
        The concurrency, and a note for the user when a server reports no limit.
    """
    capacities = [capacity_from_health(health) for health in healths]
    capacity = None if None in capacities else sum(c for c in capacities if c is not None)
    note = None
    if options.concurrency is not None:
        concurrency = options.concurrency
    elif capacity is not None:
        concurrency = capacity
    else:
        concurrency = DEFAULT_CONCURRENCY_WITHOUT_LIMIT
        which = "the server" if len(healths) == 1 else "a server"
        note = (
            f"rollout-eval: {which} reports no concurrency limit; running {concurrency} at a "
            "time (set --concurrency to change)"
        )
    return min(concurrency, pending), note
