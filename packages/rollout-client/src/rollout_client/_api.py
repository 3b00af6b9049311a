"""``RolloutApi``: the calls :class:`~rollout_client.RolloutClient` and
:class:`~rollout_client.RolloutClientPool` share, implemented once.

The osmosis-ai signature of ``run_rollout_async`` is stated here and nowhere else; it turns
its arguments into one :class:`~rollout_types.RolloutInitRequest` and hands that to the
subclass's ``_submit``, which chooses the server (one :class:`ServerChannel`, or the
pool's routing). ``run_rollout`` is ``run_rollout_async`` followed by awaiting the handle,
with the same parameters.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

from rollout_types import RolloutInitRequest, RolloutResultResponse

from ._admission import rollout_request
from ._channel import ServerChannel
from ._handle import RolloutHandle

__all__ = ["RolloutApi", "retime"]

_P = ParamSpec("_P")
_A = TypeVar("_A", bound="RolloutApi")
_R = TypeVar("_R")


def _after_admission(
    admission: Callable[Concatenate[_A, _P], Awaitable[RolloutHandle]],
) -> Callable[
    [Callable[[_A, RolloutHandle], Awaitable[_R]]],
    Callable[Concatenate[_A, _P], Coroutine[Any, Any, _R]],
]:
    """Give ``then(self, handle)`` the parameters of ``admission``: the method made admits
    with them, then returns ``then`` of the handle (its docstring and return are ``then``'s).
    """

    def decorate(
        then: Callable[[_A, RolloutHandle], Awaitable[_R]],
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

        Returns:
            The handle; await it for the terminal result.

        Raises:
            ValueError: The request is invalid (checked before any I/O); for a pool also
                a ``rollout_id`` in flight through the pool already.
            TypeError: ``rollout_id`` is not a string or ``grade`` not a bool.
            RolloutProtocolVersionError: The server speaks an incompatible protocol
                version (also an osmosis-ai <= 0.3.2 server, answering 422).
            RolloutProtocolError: Any status but 202 and 429 (409 for a duplicate id, 503
                while the server shuts down, ...), or an invalid 202 body; for a pool any
                status but 202, 429, 502, 503 and 504.
            RolloutServersUnavailableError: A pool has no server that can take the rollout
                (its ``reasons`` say why, per server).
            RolloutAdmissionTimeoutError: ``admission_timeout_sec`` expired.
            aiohttp.ClientError: The POST failed on a transport error (not retried; a pool
                tries another server instead).
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


def retime(api: RolloutApi, changes: dict[str, Any]) -> None:
    """Replace timing fields of every server's channel of ``api`` (the seam of
    :func:`rollout_client.testing.override_timing`)."""
    for channel in api._channels():
        channel.override_timing(changes)
