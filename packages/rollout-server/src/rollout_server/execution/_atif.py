"""The ``trajectory.json`` document: a rollout's conversation as an ATIF trajectory.

ATIF (the Agent Trajectory Interchange Format, RFC 0001 of the Harbor project) is the JSON
document that osmosis-ai's tools read back (``osmosis eval run`` waits for it, its upload
validates it). :func:`build_trajectory` writes version ``ATIF-v1.7``:

=======================  ===============================================================
key                      value
=======================  ===============================================================
``schema_version``       ``"ATIF-v1.7"``
``session_id``           the rollout id
``trajectory_id``        the rollout id
``agent``                ``{"name": "rollout-server", "version": ...}``
``steps``                the saved sample's ``trajectory_messages``, converted (below)
``final_metrics``        ``{"total_steps": N}``
``extra.osmosis``        what osmosis-ai's readers look for: ``rollout_id``, then, when
                         not null, ``label`` (the sample's, else the request's),
                         ``reward``, ``sample_metrics`` and ``sample_extra_fields`` (when
                         not empty), ``request_metadata``, ``request_extra_fields``
``extra.rollout_server`` the rest of the record: ``status``, ``err_message`` and
                         ``err_category`` (as the caller is told), ``remove_sample``,
                         ``workflow_info``, ``request`` (``agent_timeout_sec``,
                         ``grader_timeout_sec``, ``grade``), ``phases`` (``workflow`` and
                         ``grader``: null or ``{status, err_message, err_category}``),
                         ``timings`` (``queued_sec``, ``workflow_sec``, ``grader_sec``,
                         ``total_sec``: float seconds), ``saved_at`` (UTC, ISO 8601),
                         and ``model_turns`` when the server's model gateway captured
                         calls (below)
=======================  ===============================================================

Captured model turns (a server with ``--gateway``): each assistant message is matched, in
order, with the first captured turn after the previous match whose answer is that message
(same content, same tool calls: ids, names and arguments). A matched agent step gets ATIF
``metrics``: ``prompt_token_ids``, ``completion_token_ids``, ``logprobs`` (each when the
endpoint returned it), ``prompt_tokens`` and ``completion_tokens`` (their lengths), and
``extra`` (``turn_index``, ``weight_version``, ``latency_sec``, ``flags``).
``extra.rollout_server.model_turns`` lists every turn in call order (``index``,
``step_id`` of its agent step or null, ``endpoint``, ``status_code``, ``latency_sec``,
``weight_version``, ``finish_reason``, ``flags``); a turn matched with no step (a retried
call, an answer the workflow dropped) also keeps its ``response_message``, token ids and
logprobs there, so no captured token is lost.

There is a document only when there is a conversation: the saved sample (the grader's when
it has one, else the workflow's) has a non-empty ``trajectory_messages``.

Messages (OpenAI chat shape) become steps in order; nothing is dropped: whatever part of a
message has no ATIF field is kept in the ``extra`` of the step (or observation result, or
tool call) it went to.

* ``system`` and ``developer`` messages are ``system`` steps, ``user`` messages ``user``
  steps, ``assistant`` messages ``agent`` steps; a message of any other role (or no role)
  is a ``user`` step whose ``extra`` keeps the role.
* ``content``: a string is the step's ``message``; ``None`` is ``""``; a list of parts is a
  list of ATIF content parts: ``text`` parts as they are, ``image_url`` parts whose http(s)
  URL names a ``.png``, ``.jpg``/``.jpeg``, ``.gif`` or ``.webp`` file as ``image`` parts
  (the URL is the image's ``path``). When a part cannot be converted whole, the original
  list stays in ``extra["content"]`` too.
* An agent step's ``tool_calls`` become ATIF tool calls: ``id`` is ``tool_call_id``
  (``step<N>-call<K>`` when it has none), ``function.name`` is ``function_name``, and
  ``function.arguments`` (a JSON object, or a string holding one) is ``arguments``;
  arguments that are not an object give ``{}`` and stay in the tool call's ``extra``. A
  string ``reasoning_content`` is the step's ``reasoning_content``.
* ``tool`` (and legacy ``function``) messages are observation results of the agent step
  just before them; ``source_call_id`` is the message's ``tool_call_id`` when that step
  made that call (otherwise the id stays in the result's ``extra``). A result with no agent
  step before it gets a ``system`` step of its own.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

from rollout_types import RolloutTurn

from .._version import VERSION
from ._backend import ExecutionRequest, ExecutionResult, Sample

__all__ = ["ATIF_SCHEMA_VERSION", "build_trajectory", "conversation_steps"]

ATIF_SCHEMA_VERSION: Final = "ATIF-v1.7"
"""``schema_version`` of the documents :func:`build_trajectory` builds."""

AGENT_NAME: Final = "rollout-server"

_STEP_SOURCES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "agent",
}
_RESULT_ROLES: Final = frozenset({"tool", "function"})
_IMAGE_TYPES: Final = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
}
"""File extension -> media type, for the image types ATIF content parts allow."""


def _phase(result: ExecutionResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {
        "status": str(result.status),
        "err_message": result.err_message,
        "err_category": None if result.err_category is None else str(result.err_category),
    }


def build_trajectory(
    *,
    request: ExecutionRequest,
    reported: ExecutionResult,
    sample: Sample | None,
    workflow: ExecutionResult | None,
    grader: ExecutionResult | None,
    timings: Mapping[str, float | None],
    workflow_info: Mapping[str, Any] | None = None,
    turns: Sequence[RolloutTurn] = (),
) -> dict[str, Any] | None:
    """Build the ``trajectory.json`` document of one rollout (format in the module docstring).

    Args:
        request: The rollout's request.
        reported: The result the caller is told (status and error).
        sample: The sample to save (the grader's if it has one, else the workflow's), or None.
        workflow: The workflow phase's result, or None if it never ran.
        grader: The grader phase's result, or None if it did not grade.
        timings: ``queued_sec``, ``workflow_sec``, ``grader_sec``, ``total_sec``.
        workflow_info: ``AgentWorkflowOutput.info``; default empty.
        turns: The model calls the server's gateway captured, in order; default none.

    Returns:
        The document, or None when there is no conversation to save (no sample, or its
        ``trajectory_messages`` is null or empty). It holds the sample's values as they
        are: :func:`~rollout_server.execution._trajectory.encode_document` fits what strict JSON
        cannot hold when it writes it.
    """
    if sample is None or not sample.trajectory_messages:
        return None
    steps = conversation_steps(sample.trajectory_messages)
    model_turns = _attach_turns(sample.trajectory_messages, steps, turns) if turns else None
    osmosis: dict[str, Any] = {"rollout_id": request.id}
    label = request.label if sample.label is None else sample.label
    for key, value in (
        ("label", label),
        ("reward", sample.reward),
        ("sample_metrics", sample.metrics or None),
        ("sample_extra_fields", sample.extra_fields or None),
        ("request_metadata", request.metadata),
        ("request_extra_fields", request.request_extra_fields),
    ):
        if value is not None:
            osmosis[key] = value
    document: dict[str, Any] = {
        "schema_version": ATIF_SCHEMA_VERSION,
        "session_id": request.id,
        "trajectory_id": request.id,
        "agent": {"name": AGENT_NAME, "version": VERSION},
        "steps": steps,
        "final_metrics": {"total_steps": len(steps)},
        "extra": {
            "osmosis": osmosis,
            "rollout_server": {
                "status": str(reported.status),
                "err_message": reported.err_message,
                "err_category": (
                    None if reported.err_category is None else str(reported.err_category)
                ),
                "remove_sample": bool(sample.remove_sample),
                "workflow_info": dict(workflow_info or {}),
                "request": {
                    "agent_timeout_sec": request.agent_timeout_sec,
                    "grader_timeout_sec": request.grader_timeout_sec,
                    "grade": request.grade,
                },
                "phases": {"workflow": _phase(workflow), "grader": _phase(grader)},
                "timings": dict(timings),
                "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            },
        },
    }
    if model_turns is not None:
        document["extra"]["rollout_server"]["model_turns"] = model_turns
    return document


def _normal_arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            return raw
    return raw


def _answer_key(message: Any) -> str | None:
    """What identifies an assistant answer: its content and its tool calls (ids, names,
    arguments), as one canonical string; None for something that is not a message."""
    if not isinstance(message, Mapping):
        return None
    content = message.get("content")
    calls: list[Any] = []
    for call in message.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            calls.append(repr(call))
            continue
        function = call.get("function")
        function = function if isinstance(function, Mapping) else {}
        calls.append(
            [call.get("id"), function.get("name"), _normal_arguments(function.get("arguments"))]
        )
    try:
        return json.dumps([content or "", calls], sort_keys=True, default=repr)
    except (ValueError, RecursionError):
        return None


def _turn_metrics(turn: RolloutTurn) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    if turn.prompt_token_ids is not None:
        metrics["prompt_tokens"] = len(turn.prompt_token_ids)
    if turn.completion_token_ids is not None:
        metrics["completion_tokens"] = len(turn.completion_token_ids)
    for key in ("prompt_token_ids", "completion_token_ids", "logprobs"):
        value = getattr(turn, key)
        if value is not None:
            metrics[key] = value
    metrics["extra"] = {
        "turn_index": turn.index,
        "weight_version": turn.weight_version,
        "latency_sec": turn.latency_sec,
        "flags": [str(flag) for flag in turn.flags],
    }
    return metrics


def _attach_turns(
    messages: Sequence[Any], steps: list[dict[str, Any]], turns: Sequence[RolloutTurn]
) -> list[dict[str, Any]]:
    """Give each agent step the metrics of its captured turn (rules in the module
    docstring); return ``model_turns``."""
    # Each assistant message is exactly one agent step, in the same order.
    agent_steps = [step for step in steps if step["source"] == "agent"]
    answers = [
        message
        for message in messages
        if isinstance(message, Mapping) and message.get("role") == "assistant"
    ]
    keys = [
        None if turn.response_message is None else _answer_key(turn.response_message)
        for turn in turns
    ]
    step_of: dict[int, int] = {}
    start = 0
    for message, step in zip(answers, agent_steps, strict=True):
        key = _answer_key(message)
        if key is None:
            continue
        for position in range(start, len(turns)):
            if keys[position] == key:
                step["metrics"] = _turn_metrics(turns[position])
                step_of[position] = step["step_id"]
                start = position + 1
                break
    listed = []
    for position, turn in enumerate(turns):
        entry: dict[str, Any] = {
            "index": turn.index,
            "step_id": step_of.get(position),
            "endpoint": turn.endpoint,
            "status_code": turn.status_code,
            "latency_sec": turn.latency_sec,
            "weight_version": turn.weight_version,
            "finish_reason": turn.finish_reason,
            "flags": [str(flag) for flag in turn.flags],
        }
        if position not in step_of:
            entry["response_message"] = turn.response_message
            entry["prompt_token_ids"] = turn.prompt_token_ids
            entry["completion_token_ids"] = turn.completion_token_ids
            entry["logprobs"] = turn.logprobs
        listed.append(entry)
    return listed


def conversation_steps(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Convert chat messages into ATIF steps (rules in the module docstring).

    Args:
        messages: The conversation, in order; items that are not objects become ``user``
            steps that keep the item in ``extra["message"]``.

    Returns:
        The steps, numbered from 1; one at least when ``messages`` is not empty. The
        messages are not changed; the steps share their values (not copies).
    """
    steps: list[dict[str, Any]] = []
    for message in messages:
        # ``rest``: what is left of the message to convert; the remainder is the ``extra``.
        rest = dict(message) if isinstance(message, Mapping) else {"message": message}
        role = rest.get("role")
        role = role if isinstance(role, str) else None
        if role in _RESULT_ROLES:
            _add_result(steps, rest)
            continue
        source = _STEP_SOURCES.get(role) if role is not None else None
        if source is None:
            source = "user"  # the unknown role stays in ``extra``
        else:
            del rest["role"]
        step: dict[str, Any] = {
            "step_id": len(steps) + 1,
            "source": source,
            "message": _content(rest),
        }
        if source == "agent":
            calls = _tool_calls(rest, step["step_id"])
            if calls:
                step["tool_calls"] = calls
            if isinstance(rest.get("reasoning_content"), str):
                step["reasoning_content"] = rest.pop("reasoning_content")
        if rest:
            step["extra"] = rest
        steps.append(step)
    return steps


def _add_result(steps: list[dict[str, Any]], rest: dict[str, Any]) -> None:
    """Attach a tool message (``rest``, a copy that is consumed) as an observation result."""
    previous = steps[-1] if steps else None
    if previous is None or previous["source"] != "agent":
        result: dict[str, Any] = {"content": _content(rest)}
        if rest:
            result["extra"] = rest  # keeps the role
        steps.append(
            {
                "step_id": len(steps) + 1,
                "source": "system",
                "message": "",
                "observation": {"results": [result]},
            }
        )
        return
    if rest["role"] == "tool":
        del rest["role"]  # implied by the result's place (a legacy "function" role stays)
    result = {}
    call_id = rest.get("tool_call_id")
    if isinstance(call_id, str) and any(
        call["tool_call_id"] == call_id for call in previous.get("tool_calls", ())
    ):
        result["source_call_id"] = rest.pop("tool_call_id")
    result["content"] = _content(rest)
    if rest:
        result["extra"] = rest
    previous.setdefault("observation", {"results": []})["results"].append(result)


def _content(rest: dict[str, Any]) -> str | list[dict[str, Any]]:
    """The ATIF ``message``/``content`` of a message; ``content`` leaves ``rest`` when it
    was converted whole."""
    content = rest.get("content")
    if content is None or isinstance(content, str):
        rest.pop("content", None)
        return content or ""
    if not isinstance(content, list):
        return ""  # kept in ``extra``
    parts = []
    whole = True
    for part in content:
        converted, exact = _part(part)
        if converted is not None:
            parts.append(converted)
        whole = whole and exact
    if whole:
        del rest["content"]
    return parts or ""


def _part(part: Any) -> tuple[dict[str, Any] | None, bool]:
    """An ATIF content part for a chat content part (or None), and whether it is exact."""
    if not isinstance(part, Mapping):
        return None, False
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if isinstance(text, str):
            return {"type": "text", "text": text}, part.keys() <= {"type", "text"}
        return None, False
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        media_type = _image_media_type(url)
        if media_type is None:
            return None, False
        exact = part.keys() <= {"type", "image_url"} and (
            not isinstance(image, Mapping) or image.keys() <= {"url"}
        )
        return {"type": "image", "source": {"media_type": media_type, "path": url}}, exact
    return None, False


def _image_media_type(url: Any) -> str | None:
    """The media type of an http(s) image URL, from its file extension; else None."""
    if not isinstance(url, str):
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme not in {"http", "https"}:
        return None
    dot = parts.path.rfind(".")
    return None if dot < 0 else _IMAGE_TYPES.get(parts.path[dot:].lower())


def _tool_calls(rest: dict[str, Any], step_id: int) -> list[dict[str, Any]] | None:
    """The ATIF tool calls of an assistant message; ``tool_calls`` leaves ``rest`` when it
    is null or a list of objects (anything else stays in ``extra``)."""
    raw = rest.get("tool_calls")
    if raw is None:
        rest.pop("tool_calls", None)
        return None
    if not isinstance(raw, list) or not all(isinstance(call, Mapping) for call in raw):
        return None
    del rest["tool_calls"]
    return [_tool_call(dict(call), f"step{step_id}-call{k}") for k, call in enumerate(raw, 1)]


def _tool_call(call: dict[str, Any], fallback_id: str) -> dict[str, Any]:
    call_id = call.pop("id", None)
    if not isinstance(call_id, str) or not call_id:
        if call_id is not None:
            call["id"] = call_id  # kept, not usable as an ATIF id
        call_id = fallback_id
    name = ""
    arguments: dict[str, Any] = {}
    function = call.get("function")
    if isinstance(function, Mapping):
        left = dict(function)
        if isinstance(left.get("name"), str):
            name = left.pop("name")
        parsed = _arguments(left.get("arguments"))
        if parsed is not None:
            arguments = parsed
            left.pop("arguments", None)
        if left:
            call["function"] = left
        else:
            del call["function"]
    if call.get("type") == "function":
        del call["type"]
    converted: dict[str, Any] = {
        "tool_call_id": call_id,
        "function_name": name,
        "arguments": arguments,
    }
    if call:
        converted["extra"] = call
    return converted


def _arguments(raw: Any) -> dict[str, Any] | None:
    """Tool call arguments as a JSON object, or None when they are not one."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        return parsed if isinstance(parsed, dict) else None
    return None
