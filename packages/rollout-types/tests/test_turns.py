"""Protocol 1.1: the turn keys are optional, omitted at their defaults, and strictly typed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_types import (
    PROTOCOL_VERSION,
    TURNS_PROTOCOL_VERSION,
    RolloutInitRequest,
    RolloutResultResponse,
    RolloutSample,
    RolloutTurn,
    TurnFlag,
    WireValidationError,
    converter,
    dumps,
    protocol_supports,
    structure_wire,
)

V10_RESULT = (
    '{"rollout_id":"r1","status":"success","sample":{"messages":[{"role":"user","content":"hi"}],'
    '"label":"4","reward":1.0,"remove_sample":false,"metrics":{},"extra_fields":{}},'
    '"err_message":null,"err_category":null}'
)
"""A protocol 1.0 result document, as rollout-types 0.2 encoded it."""

V10_REQUEST = (
    '{"initial_messages":[],"rollout_id":"r1","chat_completions_url":"http://m/v1",'
    '"label":null,"metadata":null,"llm_api_key":null,"grade":true,"agent_timeout_sec":null,'
    '"grader_timeout_sec":null,"extra_fields":null}'
)


def turn(**fields: Any) -> RolloutTurn:
    return RolloutTurn(**{"index": 0, "endpoint": "http://m/v1", **fields})


class TestWireOfOlderPeers:
    def test_result_without_turns_is_the_10_document(self) -> None:
        """A result without turns encodes to exactly the 1.0 bytes."""
        result = RolloutResultResponse(
            rollout_id="r1",
            status="success",
            sample=RolloutSample(
                messages=[{"role": "user", "content": "hi"}], label="4", reward=1.0
            ),
        )
        assert dumps(result) == V10_RESULT

    def test_request_without_new_keys_is_the_10_document(self) -> None:
        """A request that sets none of the 1.1 keys encodes to exactly the 1.0 bytes."""
        request = RolloutInitRequest(
            initial_messages=[], rollout_id="r1", chat_completions_url="http://m/v1"
        )
        assert dumps(request) == V10_REQUEST

    def test_10_documents_structure(self) -> None:
        """1.0 documents structure with the new fields at their defaults."""
        result = structure_wire(json.loads(V10_RESULT), RolloutResultResponse)
        assert result.turns is None
        request = structure_wire(json.loads(V10_REQUEST), RolloutInitRequest)
        assert (request.return_turns, request.weight_version, request.group_id) == (
            False,
            None,
            None,
        )


class TestTurns:
    def test_roundtrip(self) -> None:
        """A result with turns structures back to itself, flags as enum members."""
        result = RolloutResultResponse(
            rollout_id="r1",
            status="failure",
            turns=[
                turn(
                    request_messages=[{"role": "user", "content": "hi"}],
                    response_message={"role": "assistant", "content": "yo"},
                    finish_reason="stop",
                    prompt_token_ids=[1, 2],
                    completion_token_ids=[3],
                    logprobs=[-0.25],
                    weight_version="step-7",
                    status_code=200,
                    latency_sec=0.01,
                ),
                turn(index=1, flags=[TurnFlag.UNREACHABLE]),
            ],
        )
        document = converter.unstructure(result)
        assert list(document)[-1] == "turns"
        assert structure_wire(json.loads(dumps(result)), RolloutResultResponse) == result

    def test_unknown_flag_stays_visible(self) -> None:
        """A flag a newer server introduced structures as its raw string."""
        data = {"rollout_id": "r", "status": "success", "turns": [
            {"index": 0, "endpoint": "e", "flags": ["no_logprobs", "from_the_future"]}
        ]}  # fmt: skip
        parsed = structure_wire(data, RolloutResultResponse)
        assert parsed.turns is not None
        assert parsed.turns[0].flags == [TurnFlag.NO_LOGPROBS, "from_the_future"]

    def test_token_ids_are_integers(self) -> None:
        """A token id that is not an integer is a 422 at its location."""
        data = {"rollout_id": "r", "status": "success", "turns": [
            {"index": 0, "endpoint": "e", "completion_token_ids": [1, "2"]}
        ]}  # fmt: skip
        with pytest.raises(WireValidationError) as caught:
            structure_wire(data, RolloutResultResponse)
        assert caught.value.errors[0]["loc"] == ["body", "turns", 0, "completion_token_ids", 1]

    @pytest.mark.parametrize("key", ["weight_version", "group_id"])
    def test_empty_strings_refused(self, key: str) -> None:
        """An empty weight_version or group_id is a 422 (omit the key instead)."""
        data = json.loads(V10_REQUEST)
        data[key] = ""
        with pytest.raises(WireValidationError) as caught:
            structure_wire(data, RolloutInitRequest)
        assert caught.value.errors[0]["loc"] == ["body", key]

    def test_return_turns_is_strictly_boolean(self) -> None:
        """``return_turns: 1`` is not a boolean."""
        data = {**json.loads(V10_REQUEST), "return_turns": 1}
        with pytest.raises(WireValidationError):
            structure_wire(data, RolloutInitRequest)


class TestNegotiation:
    def test_current_version_supports_turns(self) -> None:
        """This release speaks the turns protocol."""
        assert protocol_supports(PROTOCOL_VERSION, TURNS_PROTOCOL_VERSION)

    @pytest.mark.parametrize(
        ("advertised", "expected"),
        [("1.0", False), (None, False), ("1.1", True), ("1.7", True), ("2.1", False), ("x", False)],
    )
    def test_supports(self, advertised: str | None, expected: bool) -> None:
        """Same major and at least the needed minor; no header means 1.0 (osmosis-ai)."""
        assert protocol_supports(advertised, "1.1") is expected


def test_every_11_key_is_omitted_at_its_default() -> None:
    """Each key the converter lists as 1.1 is absent at its default and present otherwise."""
    from rollout_types._converter import OMITTED_WHEN_DEFAULT

    request = RolloutInitRequest(initial_messages=[], rollout_id="r", chat_completions_url="u")
    result = RolloutResultResponse(rollout_id="r", status="success")
    changed = {
        RolloutInitRequest: RolloutInitRequest(
            initial_messages=[],
            rollout_id="r",
            chat_completions_url="u",
            return_turns=True,
            weight_version="7",
            group_id="g",
        ),
        RolloutResultResponse: RolloutResultResponse(rollout_id="r", status="success", turns=[]),
    }
    for model, keys in OMITTED_WHEN_DEFAULT.items():
        default = request if model is RolloutInitRequest else result
        assert not set(keys) & set(converter.unstructure(default)), model
        assert set(keys) <= set(converter.unstructure(changed[model])), model
