"""Every body the server sends comes from the converter, including the cheap in-progress one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_server.state._bodies import (
    detail_body,
    encode,
    encode_json,
    progress_body,
    result_body,
)
from rollout_types import (
    RolloutErrorCategory,
    RolloutResultResponse,
    RolloutSample,
    RolloutStatus,
    converter,
)

GOLDEN = Path(__file__).resolve().parents[2] / "rollout-types" / "tests" / "data" / "golden"


class TestProgressBody:
    @given(rollout_id=st.text(), status=st.sampled_from(RolloutStatus))
    def test_the_same_bytes_as_the_converter(self, rollout_id: str, status: RolloutStatus) -> None:
        """For any id (quotes, control characters, lone surrogates) and status, the
        template-made body is byte for byte what encoding the model gives."""
        expected = encode(RolloutResultResponse(rollout_id=rollout_id, status=status))
        assert progress_body(rollout_id, status) == expected

    def test_the_keys_of_osmosis_in_progress_answer(self) -> None:
        """The body has exactly the keys osmosis-ai answers for a running rollout, every
        field but id and status null."""
        theirs = json.loads((GOLDEN / "osmosis-0.3.8" / "result_running.json").read_text())
        ours = json.loads(progress_body("r1", RolloutStatus.RUNNING))
        assert ours == {**dict.fromkeys(theirs), "rollout_id": "r1", "status": "running"}


class TestResultBody:
    def test_a_result_round_trips(self) -> None:
        """A published result decodes and structures back to the same model."""
        sample = RolloutSample(messages=[{"role": "assistant", "content": "é"}], reward=0.5)
        body = result_body(
            rollout_id="r1",
            status=RolloutStatus.FAILURE,
            sample=sample,
            err_message="boom",
            err_category=RolloutErrorCategory.AGENT_ERROR,
        )
        assert converter.structure(json.loads(body), RolloutResultResponse) == (
            RolloutResultResponse(
                rollout_id="r1",
                status=RolloutStatus.FAILURE,
                sample=sample,
                err_message="boom",
                err_category=RolloutErrorCategory.AGENT_ERROR,
            )
        )


class TestEncoding:
    def test_a_lone_surrogate_is_written_back_as_its_escape(self) -> None:
        """Text with a lone surrogate (no UTF-8 form) encodes as valid JSON that decodes to
        the same value."""
        body = encode({"id": "a\ud800b"})
        assert b"\\ud800" in body
        assert json.loads(body) == {"id": "a\ud800b"}
        assert encode_json('"plain"') == b'"plain"'

    def test_a_detail_body(self) -> None:
        """Errors are {"detail": ...}, compact."""
        assert detail_body("unauthorized") == b'{"detail":"unauthorized"}'

    def test_non_finite_numbers_are_refused(self) -> None:
        """The encoding is strict JSON: NaN is an error, never a NaN literal."""
        with pytest.raises(ValueError):
            encode({"x": float("nan")})
