"""Each validation rule of the wire protocol, with a failing input and its exact 422 ``loc``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_types import (
    REDACTED,
    CancelRolloutsRequest,
    RolloutHealth,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutResultResponse,
    WireValidationError,
    loads,
    structure_wire,
)


def init_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "initial_messages": [{"role": "user", "content": "What is 6 * 7?"}],
        "rollout_id": "r1",
        "chat_completions_url": "http://127.0.0.1:9000/v1",
        "label": None,
        "metadata": None,
        "llm_api_key": None,
        "grade": True,
        "agent_timeout_sec": None,
        "grader_timeout_sec": None,
        "extra_fields": None,
    }
    body.update(overrides)
    return body


def errors_of(data: Any, cls: type[Any] = RolloutInitRequest) -> list[dict[str, Any]]:
    with pytest.raises(WireValidationError) as info:
        structure_wire(data, cls)
    # Every 422 body must itself be strict JSON.
    json.dumps(info.value.body, allow_nan=False)
    return info.value.errors


class TestRolloutId:
    @pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "a\\b", "a\x00b", "/"])
    def test_not_a_single_segment(self, bad: str) -> None:
        """An id that is empty, a dot name, or holds a separator or NUL is a value_error."""
        (error,) = errors_of(init_body(rollout_id=bad))
        assert error["loc"] == ["body", "rollout_id"]
        assert error["type"] == "value_error"
        assert error["msg"] == (
            "Value error, rollout_id must be a single path segment "
            "(no path separators, and not '.' or '..')"
        )
        assert error["ctx"] == {"error": {}}

    @pytest.mark.parametrize("good", ["a b", "a?b", "a#b", "a%2Fb", "ünïcode", "x" * 5000, "..."])
    def test_other_characters_accepted(self, good: str) -> None:
        """Spaces, URL-significant characters, non-ASCII and long ids are accepted."""
        assert structure_wire(init_body(rollout_id=good), RolloutInitRequest).rollout_id == good

    @pytest.mark.parametrize("bad", [5, 1.5, True, None, ["r1"], {"id": "r1"}])
    def test_wrong_json_type(self, bad: Any) -> None:
        """A non-string id is a string_type error, never coerced."""
        (error,) = errors_of(init_body(rollout_id=bad))
        assert error["loc"] == ["body", "rollout_id"]
        assert error["type"] == "string_type"


class TestLlmApiKey:
    def test_empty_rejected_and_redacted(self) -> None:
        """An empty llm_api_key is a value_error at its loc."""
        (error,) = errors_of(init_body(llm_api_key=""))
        assert error["loc"] == ["body", "llm_api_key"]
        assert error["msg"] == "Value error, llm_api_key must be omitted or a non-empty string"

    def test_whitespace_accepted(self) -> None:
        """A whitespace-only key is accepted, as osmosis accepts it."""
        assert structure_wire(init_body(llm_api_key="   "), RolloutInitRequest).llm_api_key == "   "

    def test_key_never_echoed(self) -> None:
        """A body-level error echoes the body with llm_api_key (and other secrets) redacted."""
        body = init_body(llm_api_key="sk-secret", metadata={"api_token": "t0k", "ok": 1})
        del body["rollout_id"]
        (error,) = errors_of(body)
        assert error["type"] == "missing"
        assert error["loc"] == ["body", "rollout_id"]
        assert error["input"]["llm_api_key"] == REDACTED
        assert error["input"]["metadata"] == {"api_token": REDACTED, "ok": 1}
        assert "sk-secret" not in json.dumps(error)
        assert "t0k" not in json.dumps(error)

    def test_key_not_in_repr(self) -> None:
        """The key does not show in the model's repr (logs)."""
        request = structure_wire(init_body(llm_api_key="sk-secret"), RolloutInitRequest)
        assert "sk-secret" not in repr(request)


class TestTimeouts:
    @pytest.mark.parametrize("field", ["agent_timeout_sec", "grader_timeout_sec"])
    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
    def test_non_finite_rejected(self, field: str, bad: float) -> None:
        """NaN and infinities are a finite_number error with a JSON-safe input."""
        (error,) = errors_of(init_body(**{field: bad}))
        assert error["loc"] == ["body", field]
        assert error["type"] == "finite_number"
        assert isinstance(error["input"], str)

    def test_non_finite_from_json_literal(self) -> None:
        """A NaN literal in the raw body decodes and is rejected, never a crash."""
        raw = json.dumps(init_body()).replace(
            '"agent_timeout_sec": null', '"agent_timeout_sec": NaN'
        )
        (error,) = errors_of(loads(raw))
        assert error["loc"] == ["body", "agent_timeout_sec"]

    @pytest.mark.parametrize("value", [0, -1, 0.5, 10**6])
    def test_zero_negative_finite_accepted(self, value: float) -> None:
        """Zero, negative and large finite timeouts are accepted (they mean expired/long)."""
        request = structure_wire(init_body(agent_timeout_sec=value), RolloutInitRequest)
        assert request.agent_timeout_sec == float(value)

    @pytest.mark.parametrize("bad", ["5", True, [1]])
    def test_wrong_type(self, bad: Any) -> None:
        """A string, boolean or list for a timeout is a float_type error."""
        (error,) = errors_of(init_body(grader_timeout_sec=bad))
        assert error["type"] == "float_type"
        assert error["loc"] == ["body", "grader_timeout_sec"]


class TestMessagesAndShapes:
    def test_message_not_object(self) -> None:
        """Each initial message must be an object; the loc names its index."""
        (error,) = errors_of(init_body(initial_messages=[{"role": "user"}, "hi"]))
        assert error["loc"] == ["body", "initial_messages", 1]
        assert error["type"] == "dict_type"

    def test_messages_not_list(self) -> None:
        """initial_messages that is not an array is a list_type error."""
        (error,) = errors_of(init_body(initial_messages="hi"))
        assert error["loc"] == ["body", "initial_messages"]
        assert error["type"] == "list_type"

    def test_empty_messages_accepted(self) -> None:
        """An empty message list is accepted."""
        assert (
            structure_wire(init_body(initial_messages=[]), RolloutInitRequest).initial_messages
            == []
        )

    @pytest.mark.parametrize("field", ["initial_messages", "rollout_id", "chat_completions_url"])
    def test_required_fields(self, field: str) -> None:
        """Each required key, when missing, is reported as missing at its loc."""
        body = init_body()
        del body[field]
        (error,) = errors_of(body)
        assert error == {
            "type": "missing",
            "loc": ["body", field],
            "msg": "Field required",
            "input": body,
        }

    @pytest.mark.parametrize("data", [[], "x", 3, None])
    def test_body_not_object(self, data: Any) -> None:
        """A body that is not an object is model_attributes_type at loc body."""
        (error,) = errors_of(data)
        assert error["loc"] == ["body"]
        assert error["type"] == "model_attributes_type"

    def test_invalid_json(self) -> None:
        """Undecodable JSON gives json_invalid with a body position loc."""
        with pytest.raises(WireValidationError) as info:
            loads(b'{"a": ')
        (error,) = info.value.errors
        assert error["type"] == "json_invalid"
        assert error["loc"][0] == "body"
        assert isinstance(error["loc"][1], int)

    @pytest.mark.parametrize(
        ("field", "bad", "type_"),
        [
            ("grade", 1, "bool_type"),
            ("grade", "yes", "bool_type"),
            ("metadata", [], "dict_type"),
            ("extra_fields", "x", "dict_type"),
            ("label", 3, "string_type"),
        ],
    )
    def test_strict_types(self, field: str, bad: Any, type_: str) -> None:
        """Optional fields check their JSON type strictly."""
        (error,) = errors_of(init_body(**{field: bad}))
        assert (error["loc"], error["type"]) == (["body", field], type_)

    def test_unknown_keys_ignored(self) -> None:
        """Unknown keys (such as pre-0.3.3 callback fields) are ignored."""
        body = init_body(completion_callback_url="http://x", controller_api_key="k", future=1)
        assert structure_wire(body, RolloutInitRequest).rollout_id == "r1"

    def test_several_errors_reported(self) -> None:
        """Independent type errors are all reported in one 422."""
        errors = errors_of(init_body(rollout_id=1, grade="x", metadata=3))
        assert sorted(e["loc"][1] for e in errors) == ["grade", "metadata", "rollout_id"]


class TestInitResponse:
    def base(self, **overrides: Any) -> dict[str, Any]:
        body = {
            "rollout_id": "r1",
            "status": "queued",
            "polling_lease_token": "t" * 43,
            "result_wait_timeout_sec": 1.0,
            "polling_lease_timeout_sec": 3.0,
        }
        body.update(overrides)
        return body

    @pytest.mark.parametrize(("wait", "lease"), [(1.0, 1.0), (2.0, 1.0)])
    def test_lease_must_exceed_wait(self, wait: float, lease: float) -> None:
        """polling_lease_timeout_sec must be strictly greater than the wait."""
        (error,) = errors_of(
            self.base(result_wait_timeout_sec=wait, polling_lease_timeout_sec=lease),
            RolloutInitResponse,
        )
        assert error["loc"] == ["body", "polling_lease_timeout_sec"]

    @pytest.mark.parametrize("wait", [0, -1, float("inf")])
    def test_wait_positive_finite(self, wait: float) -> None:
        """The wait must be finite and greater than zero."""
        errors = errors_of(self.base(result_wait_timeout_sec=wait), RolloutInitResponse)
        assert errors[0]["loc"] == ["body", "result_wait_timeout_sec"]

    def test_empty_token(self) -> None:
        """An empty lease token is rejected."""
        (error,) = errors_of(self.base(polling_lease_token=""), RolloutInitResponse)
        assert error["loc"] == ["body", "polling_lease_token"]


class TestCancelSelectors:
    @pytest.mark.parametrize(
        ("body", "count"),
        [
            ({"ids": ["a"], "prefix": None, "all": False}, 1),
            ({"ids": [], "prefix": None, "all": False}, 1),
            ({"prefix": ""}, 1),
            ({"all": True}, 1),
            ({}, 0),
            ({"ids": None, "prefix": None, "all": False}, 0),
            ({"ids": ["a"], "all": True}, 2),
            ({"ids": [], "prefix": "", "all": True}, 3),
        ],
    )
    def test_selector_count(self, body: dict[str, Any], count: int) -> None:
        """[] and "" count as active selectors; null and false do not."""
        assert structure_wire(body, CancelRolloutsRequest).selector_count == count

    def test_ids_wrong_type(self) -> None:
        """ids that is not a list is a list_type error."""
        (error,) = errors_of({"ids": "x"}, CancelRolloutsRequest)
        assert (error["loc"], error["type"]) == (["body", "ids"], "list_type")


class TestForwardCompatibility:
    def test_unknown_status_and_category_kept_raw(self) -> None:
        """Unknown status and err_category strings structure as raw strings."""
        result = structure_wire(
            {
                "rollout_id": "r",
                "status": "paused",
                "sample": None,
                "err_message": None,
                "err_category": "quota",
            },
            RolloutResultResponse,
        )
        assert result.status == "paused"
        assert result.err_category == "quota"
        assert not result.is_terminal

    def test_status_must_be_string(self) -> None:
        """A non-string status is still an error."""
        (error,) = errors_of({"rollout_id": "r", "status": 3}, RolloutResultResponse)
        assert error["loc"] == ["body", "status"]


class TestHealth:
    def test_lifecycle_required(self) -> None:
        """A health document without process_id or lifecycle does not structure."""
        errors = errors_of({"status": "ok", "instance_id": "i"}, RolloutHealth)
        assert sorted(e["loc"][1] for e in errors) == ["lifecycle", "process_id"]

    def test_negative_active(self) -> None:
        """active_rollouts must be >= 0."""
        errors = errors_of(
            {
                "instance_id": "i",
                "process_id": "p",
                "lifecycle": {"accepting_rollouts": True, "active_rollouts": -1},
            },
            RolloutHealth,
        )
        assert errors[0]["loc"] == ["body", "lifecycle", "active_rollouts"]
