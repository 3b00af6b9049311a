"""The wire models of the rollout protocol as frozen, keyword-only attrs classes.

The models carry no serialisation code: :data:`rollout_types.converter` structures and
unstructures them. Validators enforce only the protocol's real invariants, so that a model
built locally (as the client does before sending) fails the same way a received document
does.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from ._enums import (
    CancelDisposition,
    RolloutErrorCategory,
    RolloutStatus,
    TurnFlag,
    is_terminal,
)
from ._errors import FieldValueError

__all__ = [
    "CancelRolloutsRequest",
    "CancelRolloutsResponse",
    "RolloutHealth",
    "RolloutInitRequest",
    "RolloutInitResponse",
    "RolloutLifecycle",
    "RolloutResultResponse",
    "RolloutSample",
    "RolloutTurn",
    "TurnFlag",
    "is_single_path_segment",
]

ROLLOUT_ID_MESSAGE = (
    "rollout_id must be a single path segment (no path separators, and not '.' or '..')"
)
LLM_API_KEY_MESSAGE = "llm_api_key must be omitted or a non-empty string"


def is_single_path_segment(value: str) -> bool:
    """Tell whether ``value`` can be one URL path segment: non-empty, not ``.``/``..``,
    and free of ``/``, ``\\`` and NUL."""
    return (
        bool(value)
        and value not in (".", "..")
        and "/" not in value
        and "\\" not in value
        and "\x00" not in value
    )


def _rollout_id(_inst: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not is_single_path_segment(value):
        raise FieldValueError(attribute.name, ROLLOUT_ID_MESSAGE)


def _finite_or_none(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not math.isfinite(value):
        raise FieldValueError(attribute.name, f"{attribute.name} must be a finite number")


def _positive_finite(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise FieldValueError(
            attribute.name, f"{attribute.name} must be a finite number greater than 0"
        )


def _llm_api_key(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value == "":
        raise FieldValueError(attribute.name, LLM_API_KEY_MESSAGE)


def _weight_version(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value:
        raise FieldValueError(
            attribute.name, "weight_version must be omitted or a non-empty string"
        )


def _group_id(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value:
        raise FieldValueError(attribute.name, "group_id must be omitted or a non-empty string")


def _messages(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise FieldValueError(
                f"{attribute.name}.{index}", "each initial message must be a JSON object"
            )


@attrs.frozen(kw_only=True)
class RolloutInitRequest:
    """Body of ``POST /rollout``: one rollout to admit.

    Timeouts are float seconds; ``None`` means unbounded, zero or negative means already
    expired. ``extra_fields`` never reaches the backend; it is persisted with the
    trajectory.

    Protocol 1.1 adds three optional keys, each sent only when it differs from its default
    (so a request that uses none of them is byte-for-byte a 1.0 request, and osmosis-ai
    servers, which ignore unknown keys, see the same document):

    * ``return_turns``: ask for the model turns the server's model gateway captured in the
      result (:attr:`RolloutResultResponse.turns`); default False. A server without a
      gateway refuses such a request (422), rather than answering without turns.
    * ``weight_version``: the policy weights' version the caller serves this rollout with
      (a trainer step, a checkpoint tag); recorded on every captured turn. Default None.
    * ``group_id``: the id of the group (GRPO: the n samples of one prompt) this rollout
      belongs to; a gateway with several model endpoints routes every rollout of a group
      to the same endpoint (its prefix cache). Default None: the rollout is its own group.

    .. versionchanged:: 0.3
       ``return_turns``, ``weight_version`` and ``group_id`` (protocol 1.1).
    """

    initial_messages: list[dict[str, Any]] = attrs.field(validator=_messages)
    rollout_id: str = attrs.field(validator=_rollout_id)
    chat_completions_url: str
    label: str | None = None
    metadata: dict[str, Any] | None = None
    llm_api_key: str | None = attrs.field(default=None, validator=_llm_api_key, repr=False)
    grade: bool = True
    agent_timeout_sec: float | None = attrs.field(default=None, validator=_finite_or_none)
    grader_timeout_sec: float | None = attrs.field(default=None, validator=_finite_or_none)
    extra_fields: dict[str, Any] | None = None
    return_turns: bool = False
    weight_version: str | None = attrs.field(default=None, validator=_weight_version)
    group_id: str | None = attrs.field(default=None, validator=_group_id)


def _lease_longer_than_wait(
    inst: RolloutInitResponse, attribute: attrs.Attribute[float], value: float
) -> None:
    _positive_finite(inst, attribute, value)
    if not value > inst.result_wait_timeout_sec:
        raise FieldValueError(
            attribute.name,
            "polling_lease_timeout_sec must be greater than result_wait_timeout_sec",
        )


def _token(_inst: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        raise FieldValueError(attribute.name, "polling_lease_token must not be empty")


@attrs.frozen(kw_only=True)
class RolloutInitResponse:
    """Body of the ``202`` answer to ``POST /rollout``.

    ``result_wait_timeout_sec`` is the server's long-poll wait and
    ``polling_lease_timeout_sec`` (strictly longer) its lease, both in seconds.
    """

    rollout_id: str
    status: RolloutStatus | str = RolloutStatus.QUEUED
    polling_lease_token: str = attrs.field(validator=_token, repr=False)
    result_wait_timeout_sec: float = attrs.field(validator=_positive_finite)
    polling_lease_timeout_sec: float = attrs.field(validator=_lease_longer_than_wait)


def _finite_reward(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not math.isfinite(value):
        raise FieldValueError(attribute.name, "reward must be a finite number")


@attrs.frozen(kw_only=True)
class RolloutSample:
    """The wire form of a rollout's sample.

    ``reward`` is null on the wire unless the status is ``success`` and ``remove_sample``
    is false. The persistence-only ``trajectory_messages`` is never part of it.
    """

    messages: list[dict[str, Any]] = attrs.Factory(list)
    label: str | None = None
    reward: float | None = attrs.field(default=None, validator=_finite_reward)
    remove_sample: bool = False
    metrics: dict[str, Any] = attrs.Factory(dict)
    extra_fields: dict[str, Any] = attrs.Factory(dict)


@attrs.frozen(kw_only=True)
class RolloutTurn:
    """One model call of a rollout, as the server's model gateway captured it (protocol 1.1).

    Token ids and logprobs are those the model endpoint returned (vLLM's and SGLang's
    OpenAI-compatible fields); the gateway asks for them when the workflow did not. A
    field the endpoint did not return, or returned malformed, is null, and ``flags`` says
    why (:class:`~rollout_types.TurnFlag`): a trainer must not train on a turn whose token
    ids are null.

    Attributes:
        index: The call's position among the rollout's model calls, from 0.
        endpoint: The model endpoint's base URL that served it (credentials removed).
        request_messages: The ``messages`` the workflow sent.
        response_message: The assistant message answered (assembled from the stream for a
            streamed call), or None when no complete answer arrived.
        finish_reason: The answer's ``finish_reason``, or None.
        prompt_token_ids: The prompt's token ids (the chat template applied), or None.
        completion_token_ids: The completion's token ids, or None.
        logprobs: One log probability per completion token (aligned with
            ``completion_token_ids``), or None.
        weight_version: The weights' version that served the call: the endpoint's own
            report when it gives one, else the request's ``weight_version``; or None.
        status_code: The endpoint's HTTP status, or None when it gave none (unreachable).
        latency_sec: Seconds from the call's arrival at the gateway to the end of the
            endpoint's answer.
        flags: What went wrong or is missing, as :class:`TurnFlag` values (raw strings for
            flags a newer server introduced); empty for a complete turn.

    .. versionadded:: 0.3
    """

    index: int
    endpoint: str
    request_messages: list[Any] = attrs.Factory(list)
    response_message: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    weight_version: str | None = None
    status_code: int | None = None
    latency_sec: float = attrs.field(default=0.0, validator=_finite_or_none)
    flags: list[TurnFlag | str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class RolloutResultResponse:
    """Body of ``GET /rollout/{id}/result``: the current or final state of a rollout.

    ``status`` and ``err_category`` are enum members for known values and the raw string
    for values a newer peer introduced, so that they stay visible without failing.

    ``turns`` (protocol 1.1) is sent only to a caller that asked for it
    (``RolloutInitRequest.return_turns``): the model calls the server's gateway captured,
    in order, on the result of a rollout whose execution returned (also when it failed);
    null, and absent from the document, otherwise. A result without turns is byte-for-byte
    a protocol 1.0 result.

    .. versionchanged:: 0.3
       ``turns``.
    """

    rollout_id: str
    status: RolloutStatus | str
    sample: RolloutSample | None = None
    err_message: str | None = None
    err_category: RolloutErrorCategory | str | None = None
    turns: list[RolloutTurn] | None = None

    @property
    def is_terminal(self) -> bool:
        """Whether the rollout has finished (``success``, ``failure`` or ``cancelled``)."""
        return is_terminal(self.status)


@attrs.frozen(kw_only=True)
class CancelRolloutsRequest:
    """Body of ``POST /rollout/cancel``: exactly one of ``ids``, ``prefix`` or ``all``.

    A selector is active when ``ids`` is not null (``[]`` counts), ``prefix`` is not null
    (``""`` counts) or ``all`` is true. :attr:`selector_count` tells how many are.
    """

    ids: list[str] | None = None
    prefix: str | None = None
    all: bool = False

    @property
    def selector_count(self) -> int:
        """How many selectors are active; the server requires exactly one."""
        return (self.ids is not None) + (self.prefix is not None) + bool(self.all)


@attrs.frozen(kw_only=True)
class CancelRolloutsResponse:
    """Body of the ``200`` answer to ``POST /rollout/cancel``: one disposition per id."""

    dispositions: dict[str, CancelDisposition | str] = attrs.Factory(dict)


def _non_negative(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise FieldValueError(attribute.name, f"{attribute.name} must be >= 0")


@attrs.frozen(kw_only=True)
class RolloutLifecycle:
    """Server lifecycle in ``/health``: whether it admits, and how many executions run."""

    accepting_rollouts: bool
    active_rollouts: int = attrs.field(validator=_non_negative)


@attrs.frozen(kw_only=True)
class RolloutHealth:
    """The ``GET /health`` payload.

    On the wire the backend's own fields (``status``, ``concurrency``, ...) sit at the top
    level beside the server's; here they are collected in ``backend``. ``protocol_version``
    is this project's (absent from osmosis-ai servers).
    """

    instance_id: str
    process_id: str
    lifecycle: RolloutLifecycle
    protocol_version: str | None = None
    backend: dict[str, Any] = attrs.Factory(lambda: {"status": "ok"})

    @property
    def status(self) -> Any:
        """The backend's ``status`` field (``"ok"`` for healthy built-in backends)."""
        return self.backend.get("status")
