"""The rollout client as the runner sees it: the calls it makes, and how it builds one.

The runner needs only ``health``, ``run_rollout_async``, ``cancel_rollout`` and ``aclose``
of :class:`~rollout_client.RolloutClient` (or, over several servers,
:class:`~rollout_client.RolloutClientPool`) and an awaitable handle; ``run_eval``'s
``client_factory`` can put any object with these methods in its place (the unit tests use
an in-memory fake).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs

from rollout_types import RolloutInitRequest

from .._client import RolloutClient
from .._pool import RolloutClientPool
from ._dataset import DatasetRow
from ._options import EvalOptions
from ._outage import OUTAGE_RETRY

__all__ = [
    "ClientFactory",
    "RunClient",
    "RunHandle",
    "default_client_factory",
    "start_rollout",
]


class RunHandle(Protocol):
    """What the runner uses of :class:`~rollout_client.RolloutHandle`."""

    rollout_id: str

    def __await__(self) -> Any: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


class RunClient(Protocol):
    """What the runner uses of :class:`~rollout_client.RolloutClient`."""

    async def health(self) -> dict[str, Any]: ...

    async def run_rollout_async(self, *args: Any, **kwargs: Any) -> Any:
        """Called with the fields of a :class:`~rollout_types.RolloutInitRequest` as
        keywords; returns a :class:`RunHandle`."""

    async def cancel_rollout(self, rollout_id: str) -> Any: ...

    async def aclose(self) -> None: ...


ClientFactory = Callable[..., RunClient]
"""Builds a client: called with ``url`` (or, for several servers, ``urls``), ``api_key`` and
``admission_timeout_sec``."""


def default_client_factory(**kwargs: Any) -> RunClient:
    """A :class:`~rollout_client.RolloutClient` with its own session, or for ``urls`` a
    :class:`~rollout_client.RolloutClientPool`.

    Unless ``retry`` is given, the client retries result polls on
    :data:`~._outage.OUTAGE_RETRY` (a refused connection is retried for up to 16.6 s, so
    polls outlast a server restart).
    """
    kwargs.setdefault("retry", OUTAGE_RETRY)
    client: RunClient = RolloutClientPool(**kwargs) if "urls" in kwargs else RolloutClient(**kwargs)
    return client


async def start_rollout(
    client: RunClient,
    *,
    options: EvalOptions,
    row: DatasetRow,
    rollout_id: str,
    item: tuple[int, int],
    group_id: str | None = None,
) -> Any:
    """Admit one work item (``row``'s prompt and label, graded); return its :class:`RunHandle`.

    ``extra_fields`` carries the item's ``row_index`` and ``run_index`` to the server;
    ``group_id`` (the row's group, with ``--n`` above 1) is sent only when set, as
    :meth:`~rollout_client.RolloutClient.run_rollout_async` sends it.

    Raises:
        ValueError: The wire model rejects the request.
    """
    request = RolloutInitRequest(
        initial_messages=row.initial_messages,
        chat_completions_url=options.chat_url,
        rollout_id=rollout_id,
        llm_api_key=options.llm_api_key,
        label=row.label,
        metadata=row.metadata,
        grade=True,
        agent_timeout_sec=options.agent_timeout_sec,
        grader_timeout_sec=options.grader_timeout_sec,
        extra_fields={"row_index": item[0], "run_index": item[1]},
    )
    fields = attrs.asdict(request, recurse=False)
    for name in ("return_turns", "weight_version", "group_id"):
        del fields[name]  # protocol 1.1 keys: passed only when set (a fake may not take them)
    if group_id is not None:
        fields["group_id"] = group_id
    return await client.run_rollout_async(**fields)
