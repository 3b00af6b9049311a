"""``RolloutApi``: the calls :class:`~rollout_client.RolloutClient` and
:class:`~rollout_client.RolloutClientPool` share, implemented once.

The osmosis-ai signature of ``run_rollout_async`` (plus the keyword-only protocol 1.1
keys) is stated here and nowhere else; it turns its arguments into one
:class:`~rollout_types.RolloutInitRequest` and hands that to the subclass's ``_submit``,
which chooses the server (one :class:`ServerChannel`, or the pool's routing, which keeps a
``group_id`` on one server). ``run_rollout`` is ``run_rollout_async`` followed by awaiting
the handle, with the same parameters; ``run_group_async`` admits a group's siblings
through ``_submit`` (``_group.py``) and ``run_group`` awaits the group.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import inspect
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

import attrs

from rollout_types import RolloutInitRequest, RolloutResultResponse

from ._admission import rollout_request
from ._channel import ServerChannel
from ._group import (
    DEFAULT_GROUP_RETRIES,
    GroupPolicy,
    RolloutGroup,
    RolloutGroupHandle,
    admit_group,
    check_group,
    sibling_id,
)
from ._handle import RolloutHandle

__all__ = ["RolloutApi", "retime"]

_P = ParamSpec("_P")
_A = TypeVar("_A", bound="RolloutApi")
_R = TypeVar("_R")
_H = TypeVar("_H", RolloutHandle, RolloutGroupHandle)


def _after_admission(
    admission: Callable[Concatenate[_A, _P], Awaitable[_H]],
) -> Callable[
    [Callable[[_A, _H], Awaitable[_R]]],
    Callable[Concatenate[_A, _P], Coroutine[Any, Any, _R]],
]:
    """Give ``then(self, handle)`` the parameters of ``admission``: the method made admits
    with them, then returns ``then`` of the handle (its docstring and return are ``then``'s).
    """

    def decorate(
        then: Callable[[_A, _H], Awaitable[_R]],
    ) -> Callable[Concatenate[_A, _P], Coroutine[Any, Any, _R]]:
        @functools.wraps(then)
        async def method(self: _A, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            return await then(self, await admission(self, *args, **kwargs))

        returns = inspect.signature(then).return_annotation
        method.__signature__ = inspect.signature(admission).replace(  # type: ignore[attr-defined]
            return_annotation=returns
        )
        method.__annotations__ = {**admission.__annotations__, "return": returns}
        return method

    return decorate


class RolloutApi(abc.ABC):
    """Rollout admission for one server or several; subclasses route ``_submit``."""

    @abc.abstractmethod
    def _channels(self) -> tuple[ServerChannel, ...]:
        """The channel of each server."""

    @abc.abstractmethod
    async def _submit(self, request: RolloutInitRequest) -> RolloutHandle:
        """Admit a checked request on a server of the subclass's choice.

        Raises:
            RuntimeError: The object is closed.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop polling and close what the object owns."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def run_rollout_async(  # noqa: PLR0917 - the documented osmosis-ai signature
        self,
        initial_messages: list[dict[str, Any]],
        chat_completions_url: str,
        rollout_id: str,
        llm_api_key: str | None = None,
        label: str | None = None,
        metadata: dict[str, Any] | None = None,
        grade: bool = True,
        agent_timeout_sec: float | None = None,
        grader_timeout_sec: float | None = None,
        extra_fields: dict[str, Any] | None = None,
        *,
        return_turns: bool = False,
        weight_version: str | None = None,
        group_id: str | None = None,
    ) -> RolloutHandle:
        """Admit a rollout and return a handle that polls its result in the background.

        Admission retries HTTP 429 after the answer's ``Retry-After`` (by default missing
        or invalid: 1 s; clamped to [0.05, 60] s; see :class:`~rollout_client.RetrySettings`)
        and accepts only a 202 whose body is valid and echoes ``rollout_id``. Nothing else
        is retried: a caller that retries after a transport error must expect 409 if the
        first attempt was in fact admitted. A :class:`~rollout_client.RolloutClientPool`
        chooses the server as its class docstring describes (a 429 there tries another
        server) and binds the handle to the server that admitted the rollout.

        Args:
            initial_messages: The prompt: a list of JSON objects (chat messages).
            chat_completions_url: Base URL of the OpenAI-compatible endpoint the agent calls.
            rollout_id: A fresh id per attempt: one path segment (not empty, ``.`` or
                ``..``, without ``/``, ``\\`` or NUL); percent-encoded in URLs.
            llm_api_key: Key for the chat endpoint (not for the rollout server); not ``""``;
                default None.
            label: Ground truth for the grader; default None.
            metadata: JSON object passed to workflow and grader; default None.
            grade: Whether to grade; default True.
            agent_timeout_sec: Workflow budget, seconds; finite; default None (unbounded).
            grader_timeout_sec: Grader budget, seconds; finite; default None (unbounded).
            extra_fields: JSON object persisted with the trajectory; default None.
            return_turns: Ask for the model turns the server's gateway captured (token ids,
                logprobs) in the result's ``turns``; default False (not sent). Needs a
                server that advertises protocol 1.1 or later and runs a gateway.
            weight_version: The policy weights' version serving this rollout, recorded on
                every captured turn; non-empty; default None (not sent).
            group_id: The group (GRPO: the n samples of one prompt) the rollout belongs
                to: a gateway routes a group to one model endpoint, a pool keeps it on one
                server; non-empty; default None (not sent). :meth:`run_group_async` sets it.

        Returns:
            The handle; await it for the terminal result.

        Raises:
            ValueError: The request is invalid (checked before any I/O); for a pool also
                a ``rollout_id`` in flight through the pool already.
            TypeError: ``rollout_id`` is not a string or ``grade`` not a bool.
            RolloutProtocolVersionError: The server speaks an incompatible protocol
                version (also an osmosis-ai <= 0.3.2 server, answering 422), or
                ``return_turns`` is set and the server that admitted the rollout
                advertises a protocol before 1.1 (it would answer without turns).
            RolloutProtocolError: Any status but 202 and 429 (409 for a duplicate id, 503
                while the server shuts down, ...), or an invalid 202 body; for a pool any
                status but 202, 429, 502, 503 and 504.
            RolloutServersUnavailableError: A pool has no server that can take the rollout
                (its ``reasons`` say why, per server).
            RolloutAdmissionTimeoutError: ``admission_timeout_sec`` expired.
            aiohttp.ClientError: The POST failed on a transport error (not retried; a pool
                tries another server instead).

        .. versionadded:: 0.3
           The keyword-only ``return_turns``, ``weight_version`` and ``group_id``
           (protocol 1.1; each sent only when set).
        """
        request = rollout_request(
            initial_messages=initial_messages,
            chat_completions_url=chat_completions_url,
            rollout_id=rollout_id,
            llm_api_key=llm_api_key,
            label=label,
            metadata=metadata,
            grade=grade,
            agent_timeout_sec=agent_timeout_sec,
            grader_timeout_sec=grader_timeout_sec,
            extra_fields=extra_fields,
            **_protocol_1_1(return_turns, weight_version, group_id),
        )
        return await self._submit(request)

    @_after_admission(run_rollout_async)
    async def run_rollout(self, handle: RolloutHandle) -> RolloutResultResponse:
        """Admit a rollout and wait until it terminates.

        Arguments, errors and admission behave as in :meth:`run_rollout_async`. If the
        calling task is cancelled, polling stops too (the server then expires the lease).

        Returns:
            The terminal result: check ``status``, ``sample``, ``err_message`` and
            ``err_category`` to tell success from execution failure.

        Raises:
            RolloutProtocolError: A poll got a status or body the protocol forbids
                (502/503/504 only after their retries).
            aiohttp.ClientError: A poll failed on a transport error it does not retry, or
                after its retries.
        """
        try:
            return await handle
        except asyncio.CancelledError:
            handle.cancel()
            raise

    async def run_group_async(
        self,
        initial_messages: list[dict[str, Any]],
        chat_completions_url: str,
        *,
        n: int,
        group_id: str | None = None,
        policy: GroupPolicy = "mask",
        max_retries: int = DEFAULT_GROUP_RETRIES,
        llm_api_key: str | None = None,
        label: str | None = None,
        metadata: dict[str, Any] | None = None,
        grade: bool = True,
        agent_timeout_sec: float | None = None,
        grader_timeout_sec: float | None = None,
        extra_fields: dict[str, Any] | None = None,
        return_turns: bool = False,
        weight_version: str | None = None,
    ) -> RolloutGroupHandle:
        """Admit a group of ``n`` sibling rollouts of one prompt (GRPO); return the handle
        that collects them.

        The siblings are ``<group_id>-0`` ... ``<group_id>-<n-1>``, each sent with
        ``group_id`` (a gateway routes the group to one model endpoint; a
        :class:`~rollout_client.RolloutClientPool` admits the whole group on one server
        while that server is in rotation), admitted concurrently, each as
        :meth:`run_rollout_async` admits one. A sibling that fails for an infrastructure
        reason (the model endpoint or a provider failed, ``http_error``; a lease expired;
        the server restarted, ``internal_error``; a transport or protocol error; an
        admission timeout; no server could take it; cancelled) is never scored:

        * ``policy="mask"``: its :class:`~rollout_client.GroupRollout` says
          ``masked=True`` and why (``mask_reason``), and its ``reward`` is None.
        * ``policy="retry"``: it is admitted again as ``<group_id>-<k>-r1``,
          ``<group_id>-<k>-r2``, ... at most ``max_retries`` times; still failing after
          that, it is masked.

        Args:
            initial_messages: The prompt, as for :meth:`run_rollout_async`.
            chat_completions_url: As for :meth:`run_rollout_async`.
            n: Siblings in the group; >= 1.
            group_id: The group's id: one path segment; default None (a fresh
                ``uuid4().hex``). Use a fresh one per group.
            policy: ``"mask"`` or ``"retry"``; default ``"mask"``.
            max_retries: Retries per sibling under ``"retry"``; >= 0; default 2.
            llm_api_key: As for :meth:`run_rollout_async`; default None.
            label: As for :meth:`run_rollout_async`; default None.
            metadata: As for :meth:`run_rollout_async`; default None.
            grade: As for :meth:`run_rollout_async`; default True.
            agent_timeout_sec: As for :meth:`run_rollout_async`; default None.
            grader_timeout_sec: As for :meth:`run_rollout_async`; default None.
            extra_fields: As for :meth:`run_rollout_async`; default None.
            return_turns: As for :meth:`run_rollout_async`; default False.
            weight_version: As for :meth:`run_rollout_async`; default None.

        Returns:
            The group's handle; await it for the :class:`~rollout_client.RolloutGroup`.

        Raises:
            ValueError: The request, ``group_id``, ``n``, ``max_retries`` or ``policy`` is
                invalid (checked before any I/O).
            TypeError: An argument has the wrong type.
            RolloutProtocolVersionError, RolloutProtocolError: A sibling's admission got
                an answer that is the caller's problem (another protocol version, 401,
                409, 422, ``return_turns`` on a server before protocol 1.1); the siblings
                admitted already stop being polled.

        .. versionadded:: 0.3
        """
        group = uuid.uuid4().hex if group_id is None else group_id
        check_group(group, n, policy, max_retries)
        base = rollout_request(
            initial_messages=initial_messages,
            chat_completions_url=chat_completions_url,
            rollout_id=sibling_id(group, 0),
            llm_api_key=llm_api_key,
            label=label,
            metadata=metadata,
            grade=grade,
            agent_timeout_sec=agent_timeout_sec,
            grader_timeout_sec=grader_timeout_sec,
            extra_fields=extra_fields,
            **_protocol_1_1(return_turns, weight_version, group),
        )

        def request_for(index: int, retry: int) -> RolloutInitRequest:
            return attrs.evolve(base, rollout_id=sibling_id(group, index, retry))

        return await admit_group(
            group_id=group,
            n=n,
            request_for=request_for,
            submit=self._submit,
            policy=policy,
            max_retries=max_retries,
        )

    @_after_admission(run_group_async)
    async def run_group(self, handle: RolloutGroupHandle) -> RolloutGroup:
        """Admit a group of sibling rollouts and wait until every sibling has ended.

        Arguments, errors and the group policy are those of :meth:`run_group_async`. If
        the calling task is cancelled, the polling of every sibling stops too.

        Returns:
            The siblings in index order (each a :class:`~rollout_client.GroupRollout`:
            its result, or ``masked=True`` and why).

        Raises:
            RolloutProtocolError: A sibling's poll got a status the protocol forbids for a
                reason that is the caller's (401, 409, 422).

        .. versionadded:: 0.3
        """
        try:
            return await handle
        except asyncio.CancelledError:
            handle.cancel()
            raise


def _protocol_1_1(
    return_turns: bool, weight_version: str | None, group_id: str | None
) -> dict[str, Any]:
    """The protocol 1.1 keys that differ from their defaults (the others are not passed)."""
    fields: dict[str, Any] = {}
    if return_turns is not False:
        fields["return_turns"] = return_turns
    if weight_version is not None:
        fields["weight_version"] = weight_version
    if group_id is not None:
        fields["group_id"] = group_id
    return fields


def retime(api: RolloutApi, changes: dict[str, Any]) -> None:
    """Replace timing fields of every server's channel of ``api`` (the seam of
    :func:`rollout_client.testing.override_timing`)."""
    for channel in api._channels():
        channel.override_timing(changes)
