"""The ambient rollout context: what agent code needs, reachable without plumbing.

The server binds a :class:`RolloutContext` around each ``backend.execute()`` call, so
workflow code anywhere below it can call :func:`get_rollout_context` to find the chat
endpoint, the LLM key and the rollout id, and trace its model calls
(:meth:`RolloutContext.model_call`). When the server runs a model gateway, the context's
URLs name the rollout's route through it (:class:`~rollout_server.ModelRoute`)
and the turns captured there are readable as :attr:`RolloutContext.captured_turns`.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Final, TypeAlias

import attrs

from rollout_types import RolloutStatus, RolloutTurn

from ..observability import _tracing
from ._backend import Sample
from ._turns import ModelRoute

__all__ = [
    "CHAT_COMPLETIONS_URL_ENV",
    "LLM_API_KEY_ENV",
    "RolloutContext",
    "SampleSource",
    "bind_rollout_context",
    "context_binding",
    "current_rollout_context",
    "get_rollout_context",
    "upstream_url",
]

CHAT_COMPLETIONS_URL_ENV: Final = "OSMOSIS_CHAT_COMPLETIONS_URL"
"""Fallback for an empty ``chat_completions_url`` (as osmosis-ai reads it)."""

LLM_API_KEY_ENV: Final = "OSMOSIS_API_KEY"
"""Fallback for a missing or empty ``llm_api_key`` (as osmosis-ai reads it)."""

SampleSource: TypeAlias = Callable[[], "Sample | Awaitable[Sample | None] | None"]
"""What :meth:`RolloutContext.register_sample_source` takes: a sync or async callable."""

_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "rollout_context", default=None
)


@attrs.define(kw_only=True, eq=False)
class RolloutContext:
    """What a running rollout's code may read and do.

    Attributes:
        rollout_id: The admitted id.
        chat_completions_url: OpenAI-style base URL of the policy model (agent SDKs append
            ``/chat/completions``); from the request, else ``$OSMOSIS_CHAT_COMPLETIONS_URL``.
            When the server runs a model gateway (``--gateway``), the rollout's route
            through it instead (:attr:`base_url`), so that a workflow's calls are captured
            without a change to it.
        api_key: Key for that endpoint; ``llm_api_key``, else ``$OSMOSIS_API_KEY`` (the
            gateway passes the workflow's ``Authorization`` header on unchanged).
        process_id: The serving process's id (``/health`` ``process_id``).
        model_route: The rollout's route through the server's model gateway, or None.
    """

    rollout_id: str
    chat_completions_url: str
    api_key: str | None = attrs.field(default=None, repr=False)
    process_id: str = ""
    _on_status: Callable[[RolloutStatus], None] = attrs.field(
        default=lambda _status: None, repr=False, alias="on_status"
    )
    _sample_source: SampleSource | None = attrs.field(default=None, repr=False)
    model_route: ModelRoute | None = attrs.field(default=None, repr=False)

    @classmethod
    def from_request(
        cls,
        *,
        rollout_id: str,
        chat_completions_url: str,
        llm_api_key: str | None,
        process_id: str,
        on_status: Callable[[RolloutStatus], None],
        model_route: ModelRoute | None = None,
    ) -> RolloutContext:
        """Build the context of one rollout, applying the environment fallbacks; with a
        ``model_route``, its ``chat_completions_url`` is the route's base URL."""
        return cls(
            rollout_id=rollout_id,
            chat_completions_url=(
                model_route.base_url
                if model_route is not None
                else chat_completions_url or os.environ.get(CHAT_COMPLETIONS_URL_ENV, "")
            ),
            api_key=llm_api_key or os.environ.get(LLM_API_KEY_ENV) or None,
            process_id=process_id,
            on_status=on_status,
            model_route=model_route,
        )

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL this rollout's model calls go to (pass it as
        ``base_url`` to an OpenAI client): the route through the server's model gateway
        when it runs one, else the request's ``chat_completions_url``.

        .. versionadded:: 0.3
        """
        return self.chat_completions_url

    @property
    def captured_turns(self) -> list[RolloutTurn]:
        """The model calls the gateway has captured for this rollout so far (a copy; empty
        without a gateway).

        .. versionadded:: 0.3
        """
        route = self.model_route
        return [] if route is None else list(route.turns)

    def model_call(
        self, model: str | None = None
    ) -> contextlib.AbstractContextManager[dict[str, str]]:
        """Trace one call to the model server: a context manager whose value is a new dict
        of headers to send with that request.

        When the server traces (OpenTelemetry, the ``[otel]`` extra), the block runs in a
        client span ``chat <model>`` under the rollout's ``workflow`` span, and the headers
        carry its ``traceparent`` (and ``tracestate``): a model server that reads them
        (vLLM with ``--otlp-traces-endpoint``) puts its own spans in the same trace as the
        trainer's request and this rollout. An exception leaving the block marks the span
        failed. Otherwise the headers are empty and nothing is recorded.

        Args:
            model: The model requested, for the span's name and ``gen_ai.request.model``.

        Example::

            rollout = get_rollout_context()
            with rollout.model_call(model) as headers:
                async with session.post(url, json=body, headers=headers) as response:
                    ...

        .. versionadded:: 0.2
        """
        return _tracing.model_call(self.rollout_id, model)

    def set_status(self, status: RolloutStatus) -> None:
        """Report a non-terminal status change; ignored once the rollout has finished."""
        self._on_status(status)

    def register_sample_source(self, source: SampleSource) -> None:
        """Register where the sample comes from when a workflow's ``run()`` returns None.

        Args:
            source: A callable taking no arguments that returns a
                :class:`~rollout_server.Sample` or None, or a coroutine function doing so
                (it is awaited within the workflow's deadline). A later registration
                replaces an earlier one.

        Raises:
            TypeError: When ``source`` is not callable.
        """
        if not callable(source):
            raise TypeError(
                "register_sample_source() needs a callable (sync or async) that returns a "
                f"Sample or None; got {source!r}"
            )
        self._sample_source = source

    async def get_sample(self) -> Sample | None:
        """The sample of the registered source (awaited if it is async), or None when no
        source is registered."""
        if self._sample_source is None:
            return None
        sample = self._sample_source()
        if inspect.isawaitable(sample):
            sample = await sample
        return sample


def upstream_url(chat_completions_url: str) -> str:
    """A request's ``chat_completions_url`` after the environment fallback (what a model
    route forwards to when the gateway has no endpoints of its own)."""
    return chat_completions_url or os.environ.get(CHAT_COMPLETIONS_URL_ENV, "")


def current_rollout_context() -> RolloutContext | None:
    """The context of the rollout this code runs for, or None outside a rollout."""
    return _current.get()


def get_rollout_context() -> RolloutContext:
    """The context of the rollout this code runs for.

    Raises:
        RuntimeError: When called outside a rollout's execution.
    """
    context = _current.get()
    if context is None:
        raise RuntimeError(
            "no rollout context: get_rollout_context() works only inside code that a "
            "rollout server runs for a rollout (a workflow, a grader, or what they call)"
        )
    return context


def context_binding(context: RolloutContext) -> contextvars.Context:
    """A copy of the current :mod:`contextvars` context with ``context`` bound as the
    ambient rollout context: for a task that runs a rollout
    (``loop.create_task(coro, context=...)``) without a binding frame of its own."""
    copied = contextvars.copy_context()
    copied.run(_current.set, context)
    return copied


@contextlib.contextmanager
def bind_rollout_context(context: RolloutContext) -> Iterator[RolloutContext]:
    """Make ``context`` the ambient rollout context inside the ``with`` block."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)
