"""Every message type unstructures to the osmosis key set and structures back to itself."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_types import (
    CancelDisposition,
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    RolloutErrorCategory,
    RolloutHealth,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutLifecycle,
    RolloutResultResponse,
    RolloutSample,
    RolloutStatus,
    WireValidationError,
    converter,
    dumps,
    loads,
    structure_wire,
)

INIT_KEYS = {
    "initial_messages", "rollout_id", "chat_completions_url", "label", "metadata",
    "llm_api_key", "grade", "agent_timeout_sec", "grader_timeout_sec", "extra_fields",
}  # fmt: skip

EXAMPLES: list[Any] = [
    RolloutInitRequest(initial_messages=[], rollout_id="r1", chat_completions_url=""),
    RolloutInitRequest(
        initial_messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        rollout_id="r 2?",
        chat_completions_url="http://127.0.0.1:9000/v1",
        label="42",
        metadata={},
        llm_api_key="k",
        grade=False,
        agent_timeout_sec=-1.0,
        grader_timeout_sec=0.5,
        extra_fields={"row_index": 3},
    ),
    RolloutInitResponse(
        rollout_id="r1",
        polling_lease_token="mxA7rmwnUBmXnHbRTuJeo2LhD2MBH5l3mhDX9ZlaWW8",
        result_wait_timeout_sec=1.0,
        polling_lease_timeout_sec=3.0,
    ),
    RolloutResultResponse(rollout_id="r1", status=RolloutStatus.RUNNING),
    RolloutResultResponse(
        rollout_id="r1",
        status=RolloutStatus.SUCCESS,
        sample=RolloutSample(
            messages=[{"role": "assistant", "content": "hi"}], label="L", reward=0.5
        ),
    ),
    RolloutResultResponse(
        rollout_id="r1",
        status=RolloutStatus.FAILURE,
        err_message="polling lease expired",
        err_category=RolloutErrorCategory.LEASE_EXPIRED,
    ),
    CancelRolloutsRequest(ids=["a", "b"]),
    CancelRolloutsRequest(prefix=""),
    CancelRolloutsRequest(all=True),
    CancelRolloutsResponse(
        dispositions={"a": CancelDisposition.CANCELLED_RUNNING, "b": CancelDisposition.NOT_FOUND}
    ),
    RolloutLifecycle(accepting_rollouts=True, active_rollouts=2),
    RolloutHealth(
        instance_id="i",
        process_id="p",
        lifecycle=RolloutLifecycle(accepting_rollouts=False, active_rollouts=0),
        protocol_version="1.0",
        backend={"status": "ok", "concurrency": {"max_concurrent": 4, "queued": 0, "running": 0}},
    ),
]


class TestRoundTrip:
    @pytest.mark.parametrize("model", EXAMPLES, ids=lambda m: type(m).__name__)
    def test_round_trip(self, model: Any) -> None:
        """dumps then loads then structure_wire gives back an equal model."""
        assert structure_wire(loads(dumps(model)), type(model)) == model

    def test_init_request_emits_every_key(self) -> None:
        """An init request carries every key, nulls included, as the osmosis client sends."""
        document = converter.unstructure(EXAMPLES[0])
        assert set(document) == INIT_KEYS
        assert document["label"] is None

    def test_result_emits_five_keys(self) -> None:
        """A result always has exactly the five osmosis keys."""
        document = converter.unstructure(EXAMPLES[3])
        assert document == {
            "rollout_id": "r1",
            "status": "running",
            "sample": None,
            "err_message": None,
            "err_category": None,
        }

    def test_sample_keys(self) -> None:
        """A sample has the six wire keys and never trajectory_messages."""
        document = converter.unstructure(EXAMPLES[4])["sample"]
        assert set(document) == {
            "messages",
            "label",
            "reward",
            "remove_sample",
            "metrics",
            "extra_fields",
        }

    def test_health_flattens_backend(self) -> None:
        """Health puts backend fields at the top level beside the server's."""
        document = converter.unstructure(EXAMPLES[-1])
        assert document["concurrency"]["max_concurrent"] == 4
        assert document["status"] == "ok"
        assert document["lifecycle"] == {"accepting_rollouts": False, "active_rollouts": 0}

    def test_missing_optional_keys_take_defaults(self) -> None:
        """Missing optional keys and explicit nulls structure the same way."""
        minimal = structure_wire({"rollout_id": "r", "status": "queued"}, RolloutResultResponse)
        assert minimal == RolloutResultResponse(rollout_id="r", status=RolloutStatus.QUEUED)

    def test_dumps_rejects_non_finite(self) -> None:
        """dumps never emits NaN or Infinity literals."""
        with pytest.raises(ValueError):
            dumps({"x": math.nan})


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
json_objects = st.dictionaries(st.text(max_size=5), json_values, max_size=3)
segment_ids = st.text(min_size=1, max_size=20).filter(
    lambda s: s not in {".", ".."} and not ({"/", "\\", "\x00"} & set(s))
)
finite = st.floats(allow_nan=False, allow_infinity=False)


class TestProperties:
    @given(
        messages=st.lists(json_objects, max_size=3),
        rollout_id=segment_ids,
        url=st.text(max_size=20),
        label=st.none() | st.text(max_size=10),
        metadata=st.none() | json_objects,
        key=st.none() | st.text(min_size=1, max_size=10),
        grade=st.booleans(),
        agent=st.none() | finite,
        grader=st.none() | finite,
        extra=st.none() | json_objects,
    )
    def test_init_request_round_trip(
        self,
        messages: Any,
        rollout_id: str,
        url: str,
        label: Any,
        metadata: Any,
        key: Any,
        grade: bool,
        agent: Any,
        grader: Any,
        extra: Any,
    ) -> None:
        """Any valid init request survives a JSON round trip unchanged."""
        request = RolloutInitRequest(
            initial_messages=messages, rollout_id=rollout_id, chat_completions_url=url, label=label,
            metadata=metadata, llm_api_key=key, grade=grade, agent_timeout_sec=agent,
            grader_timeout_sec=grader, extra_fields=extra,
        )  # fmt: skip
        assert structure_wire(json.loads(dumps(request)), RolloutInitRequest) == request

    @given(
        status=st.sampled_from(list(RolloutStatus)) | st.text(max_size=8),
        reward=st.none() | finite,
        remove=st.booleans(),
        metrics=json_objects,
        category=st.none() | st.sampled_from(list(RolloutErrorCategory)) | st.text(max_size=8),
        message=st.none() | st.text(max_size=10),
    )
    def test_result_round_trip(
        self, status: Any, reward: Any, remove: bool, metrics: Any, category: Any, message: Any
    ) -> None:
        """Any result, including unknown status/category strings, round-trips."""
        result = RolloutResultResponse(
            rollout_id="r", status=status, err_category=category, err_message=message,
            sample=RolloutSample(reward=reward, remove_sample=remove, metrics=metrics),
        )  # fmt: skip
        assert structure_wire(json.loads(dumps(result)), RolloutResultResponse) == result

    @given(data=json_values)
    def test_arbitrary_json_never_crashes(self, data: Any) -> None:
        """Any JSON document either structures or raises WireValidationError with a JSON body."""
        for cls in (
            RolloutInitRequest,
            RolloutResultResponse,
            CancelRolloutsRequest,
            RolloutHealth,
        ):
            try:
                structure_wire(data, cls)
            except WireValidationError as exc:
                failure = exc
            else:
                continue
            assert failure.errors
            json.dumps(failure.body, allow_nan=False)
