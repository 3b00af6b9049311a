"""Groups of sibling rollouts (GRPO: n samples of one prompt): ``RolloutGroupHandle``, the
results ``RolloutGroup`` and ``GroupRollout``, and the group policy.

A group ``g`` of ``n`` siblings admits the rollouts ``g-0`` ... ``g-<n-1>``, each with
``group_id=g`` (a gateway routes a group to one model endpoint; a
:class:`~rollout_client.RolloutClientPool` keeps it on one server). A sibling that fails
for an infrastructure reason (``_infra.py``: the model endpoint or a provider failed, a
lease expired, the server restarted, a transport or protocol error, no server could take
it) is never scored; the group's policy decides what happens to it:

* ``mask``: its :class:`GroupRollout` says ``masked=True`` and why (``mask_reason``); its
  ``reward`` is None, never 0.
* ``retry``: it is admitted again with a fresh id, ``g-<k>-r1``, ``g-<k>-r2``, ... up to
  ``max_retries`` times; a sibling still failing after the last retry is masked.

A failure that is the caller's (a request the server refuses, a duplicate id, the key
refused, another protocol version) is raised, after the polling of the other siblings
stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Final, Literal

import attrs

from rollout_types import RolloutInitRequest, RolloutResultResponse, RolloutTurn
from rollout_types import is_single_path_segment as _is_segment

from ._handle import RolloutHandle
from ._infra import infrastructure_exception, infrastructure_result

__all__ = [
    "DEFAULT_GROUP_RETRIES",
    "GROUP_POLICIES",
    "GroupPolicy",
    "GroupRollout",
    "RolloutGroup",
    "RolloutGroupHandle",
    "admit_group",
    "check_group",
    "sibling_id",
]

GroupPolicy = Literal["mask", "retry"]
"""What a group does with a sibling that failed for an infrastructure reason."""

GROUP_POLICIES: Final = ("mask", "retry")

DEFAULT_GROUP_RETRIES: Final = 2
"""Default bound on the retries of one sibling under the ``retry`` policy."""


def sibling_id(group_id: str, index: int, retry: int = 0) -> str:
    """The rollout id of sibling ``index`` of ``group_id``: ``<group>-<index>`` for the first
    attempt, ``<group>-<index>-r<retry>`` for a retry."""
    return f"{group_id}-{index}" if retry == 0 else f"{group_id}-{index}-r{retry}"


def check_group(group_id: object, n: object, policy: object, max_retries: object) -> None:
    """Check the group arguments of :meth:`~rollout_client.RolloutClient.run_group_async`.

    Raises:
        TypeError: ``group_id`` is not a string, ``n`` or ``max_retries`` not an int.
        ValueError: ``group_id`` is not a single path segment (so neither would the ids
            derived from it be), ``n`` < 1, ``max_retries`` < 0, or ``policy`` is not
            ``"mask"`` or ``"retry"``.
    """
    if not isinstance(group_id, str):
        raise TypeError(f"group_id must be a string; got {type(group_id).__name__}")
    if not group_id or not _is_segment(group_id):
        raise ValueError(
            "group_id must be one non-empty URL path segment (no '/', '\\' or NUL, not '.' "
            f"or '..'): the sibling ids <group>-<k> derive from it; got {group_id!r}"
        )
    for name, value, least in (("n", n, 1), ("max_retries", max_retries, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int; got {type(value).__name__}")
        if value < least:
            raise ValueError(f"{name} must be at least {least}; got {value}")
    if policy not in GROUP_POLICIES:
        raise ValueError(f"policy must be 'mask' or 'retry'; got {policy!r}")


@attrs.frozen(kw_only=True)
class GroupRollout:
    """One sibling of a group, as its last attempt ended.

    Attributes:
        index: The sibling's position in the group, from 0.
        rollout_id: The id of its last attempt (``<group>-<index>``, or
            ``<group>-<index>-r<j>`` after retries).
        attempts: The ids of every attempt, in order (the last is ``rollout_id``).
        result: The last attempt's terminal result; None when its admission or polling
            raised (``mask_reason`` says what).
        masked: The sibling failed for an infrastructure reason (after its retries, under
            ``retry``): leave it out of the group's baseline and the loss. Its ``reward``
            is None.
        mask_reason: Why it is masked (``"<category or kind>: <message>"``), or None.

    .. versionadded:: 0.3
    """

    index: int
    rollout_id: str
    attempts: tuple[str, ...]
    result: RolloutResultResponse | None
    masked: bool = False
    mask_reason: str | None = None

    @property
    def reward(self) -> float | None:
        """The grader's reward; None when masked, failed or ungraded (never a stand-in 0)."""
        if self.masked or self.result is None or self.result.sample is None:
            return None
        reward = self.result.sample.reward
        return None if reward is None else float(reward)

    @property
    def turns(self) -> list[RolloutTurn]:
        """The model turns the server's gateway captured (``return_turns``); empty when
        none came back."""
        if self.result is None or self.result.turns is None:
            return []
        return list(self.result.turns)


@attrs.frozen(kw_only=True)
class RolloutGroup:
    """The siblings of one group, in index order.

    .. versionadded:: 0.3
    """

    group_id: str
    rollouts: tuple[GroupRollout, ...]

    @property
    def unmasked(self) -> tuple[GroupRollout, ...]:
        """The siblings that count for the group (not masked)."""
        return tuple(rollout for rollout in self.rollouts if not rollout.masked)

    @property
    def rewards(self) -> list[float | None]:
        """Each sibling's reward in index order; None for a masked one (or one without)."""
        return [rollout.reward for rollout in self.rollouts]


Submit = Callable[[RolloutInitRequest], Awaitable[RolloutHandle]]
"""Admits one checked request (``RolloutApi._submit``)."""

RequestFor = Callable[[int, int], RolloutInitRequest]
"""The request of sibling ``index``'s attempt ``retry`` (0: the first)."""


async def _admit_one(submit: Submit, request: RolloutInitRequest) -> RolloutHandle | str:
    """The handle, or the infrastructure reason its admission failed (others raise)."""
    try:
        return await submit(request)
    except Exception as exc:
        reason = infrastructure_exception(exc)
        if reason is None:
            raise
        return f"admission: {reason}"


async def admit_group(
    *,
    group_id: str,
    n: int,
    request_for: RequestFor,
    submit: Submit,
    policy: GroupPolicy,
    max_retries: int,
) -> RolloutGroupHandle:
    """Admit the ``n`` siblings concurrently; return the handle that collects them.

    Raises:
        Exception: What an admission raised for a reason that is not the infrastructure's
            (the siblings admitted already stop being polled).
    """
    admissions = [asyncio.ensure_future(_admit_one(submit, request_for(k, 0))) for k in range(n)]
    try:
        await asyncio.wait(admissions, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        failed = next(
            (a.exception() for a in admissions if a.done() and not a.cancelled() and a.exception()),
            None,
        )
        if failed is not None or not all(a.done() for a in admissions):
            for admission in admissions:
                admission.cancel()
            done = await asyncio.gather(*admissions, return_exceptions=True)
            for outcome in done:
                if isinstance(outcome, RolloutHandle):
                    outcome.cancel()
    if failed is not None:
        raise failed
    firsts = [admission.result() for admission in admissions]
    return RolloutGroupHandle(
        group_id=group_id,
        firsts=firsts,
        request_for=request_for,
        submit=submit,
        policy=policy,
        max_retries=max_retries,
    )


class RolloutGroupHandle:
    """An admitted group: its siblings are polled, and retried under the ``retry`` policy,
    in the background.

    ``await handle`` returns the :class:`RolloutGroup` once every sibling has ended, or
    raises what a sibling raised for a reason that is not the infrastructure's (the other
    siblings then stop being polled). Awaiting never cancels the background work;
    :meth:`cancel` does (each sibling's polling stops; the server fails an unpolled rollout
    as ``lease_expired`` when its lease runs out).

    Created by :meth:`~rollout_client.RolloutClient.run_group_async`.

    .. versionadded:: 0.3
    """

    def __init__(
        self,
        *,
        group_id: str,
        firsts: Sequence[RolloutHandle | str],
        request_for: RequestFor,
        submit: Submit,
        policy: GroupPolicy,
        max_retries: int,
    ) -> None:
        self._group_id = group_id
        self._request_for = request_for
        self._submit = submit
        self._policy = policy
        self._max_retries = max_retries
        self._current = [sibling_id(group_id, k) for k in range(len(firsts))]
        self._handles = [first if isinstance(first, RolloutHandle) else None for first in firsts]
        self._task = asyncio.get_running_loop().create_task(
            self._collect(firsts), name=f"rollout-group:{group_id}"
        )

    def __repr__(self) -> str:
        state = "done" if self._task.done() else "running"
        return f"<RolloutGroupHandle {self._group_id!r} n={len(self._current)} {state}>"

    @property
    def group_id(self) -> str:
        """The group's id (each sibling's ``group_id``)."""
        return self._group_id

    @property
    def rollout_ids(self) -> tuple[str, ...]:
        """The id of each sibling's current (or last) attempt, in index order."""
        return tuple(self._current)

    def done(self) -> bool:
        """Whether every sibling has ended (or the group failed or was cancelled)."""
        return self._task.done()

    def cancel(self) -> bool:
        """Stop polling (and retrying) every sibling; True if the group was still running.

        The server is not asked to cancel anything: use ``cancel_rollout`` on
        :attr:`rollout_ids` for that. Awaiting the handle then raises
        :class:`asyncio.CancelledError`.
        """
        running = self._task.cancel()
        for handle in self._handles:  # also when the task was cancelled before it started
            if handle is not None:
                handle.cancel()
        return running

    def __await__(self) -> Generator[Any, None, RolloutGroup]:
        return asyncio.shield(self._task).__await__()

    async def _collect(self, firsts: Sequence[RolloutHandle | str]) -> RolloutGroup:
        tasks = [asyncio.ensure_future(self._sibling(k, first)) for k, first in enumerate(firsts)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return RolloutGroup(
            group_id=self._group_id, rollouts=tuple(task.result() for task in tasks)
        )

    async def _sibling(self, index: int, first: RolloutHandle | str) -> GroupRollout:
        attempt: RolloutHandle | str = first
        attempts = [sibling_id(self._group_id, index)]
        retry = 0
        while True:
            result: RolloutResultResponse | None = None
            if isinstance(attempt, str):
                reason = attempt
            else:
                try:
                    result = await attempt
                except asyncio.CancelledError:
                    attempt.cancel()
                    raise
                except Exception as exc:
                    infra = infrastructure_exception(exc)
                    if infra is None:
                        raise
                    reason = f"result: {infra}"
                else:
                    infra = infrastructure_result(result)
                    if infra is None:
                        return GroupRollout(
                            index=index,
                            rollout_id=attempts[-1],
                            attempts=tuple(attempts),
                            result=result,
                        )
                    reason = infra
            if self._policy != "retry" or retry >= self._max_retries:
                tried = f" (after {retry} retries)" if self._policy == "retry" else ""
                return GroupRollout(
                    index=index,
                    rollout_id=attempts[-1],
                    attempts=tuple(attempts),
                    result=result,
                    masked=True,
                    mask_reason=reason + tried,
                )
            retry += 1
            attempts.append(sibling_id(self._group_id, index, retry))
            self._current[index] = attempts[-1]
            self._handles[index] = None
            attempt = await _admit_one(self._submit, self._request_for(index, retry))
            if isinstance(attempt, RolloutHandle):
                self._handles[index] = attempt
