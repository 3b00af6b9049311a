"""The recording half of a run: journal and sample lines, progress counts, the stop rule."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollout_client import RolloutProtocolError
from rollout_client.eval import Journal, RunControl, read_journal
from rollout_client.eval._progress import Progress
from rollout_client.eval._recorder import Recorder
from rollout_types import RolloutResultResponse, RolloutSample


def success(rollout_id: str, reward: float) -> RolloutResultResponse:
    return RolloutResultResponse(
        rollout_id=rollout_id,
        status="success",
        sample=RolloutSample(messages=[{"role": "assistant", "content": "x"}], reward=reward),
    )


def lease_expired(rollout_id: str) -> RolloutResultResponse:
    return RolloutResultResponse(
        rollout_id=rollout_id, status="failure", err_category="lease_expired", err_message="gone"
    )


class Setup:
    """A recorder over a real journal in a temporary run directory."""

    def __init__(self, tmp_path: Path, journal: Journal, *, limit: int) -> None:
        self.path = tmp_path
        self.control = RunControl()
        self.stream = io.StringIO()
        self.progress = Progress(total=10, stream=self.stream, mode="off")
        self.recorder = Recorder(
            journal=journal,
            progress=self.progress,
            control=self.control,
            samples_path=tmp_path / "samples.jsonl",
            pass_threshold=0.5,
            max_consecutive_infra_failures=limit,
        )

    def outcomes(self) -> list[str]:
        return [record.outcome for record in read_journal(self.path / "events.jsonl")]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Setup]]:
    """Build a Setup (``limit``: the stop rule's limit); its journal is closed at teardown."""
    journals: list[Journal] = []

    def build(limit: int = 2) -> Setup:
        journal = Journal(tmp_path / "events.jsonl")
        journals.append(journal)
        return Setup(tmp_path, journal, limit=limit)

    yield build
    for journal in journals:
        journal.close()


class TestRecording:
    def test_result_goes_to_journal_samples_and_progress(self, make) -> None:
        """A success is journaled with its reward, its sample written, and counted as a pass."""
        setup = make()
        setup.recorder.record_result(
            (3, 1), "r1", success("r1", 0.75), latency_sec=1.5, cancel_requested=False
        )
        (record,) = read_journal(setup.path / "events.jsonl")
        assert (record.item, record.rollout_id, record.outcome, record.reward) == (
            (3, 1),
            "r1",
            "success",
            0.75,
        )
        assert record.latency_sec == 1.5
        sample = json.loads((setup.path / "samples.jsonl").read_text())
        assert (sample["row_index"], sample["run_index"], sample["reward"]) == (3, 1, 0.75)
        assert (setup.progress.done, setup.progress.passed) == (1, 1)

    def test_exception_is_an_infra_failure_with_phase(self, make) -> None:
        """A failed admission is journaled as infra_failure with its category and phase."""
        setup = make(limit=0)
        error = RolloutProtocolError("POST /rollout returned 409", status_code=409)
        setup.recorder.record_exception((0, 0), "r1", error, latency_sec=0.1, phase="admission")
        (record,) = read_journal(setup.path / "events.jsonl")
        assert (record.outcome, record.status, record.err_category) == (
            "infra_failure",
            None,
            "protocol_error",
        )
        assert record.err_message == "admission: RolloutProtocolError: POST /rollout returned 409"

    def test_refused_key_stops_without_a_record(self, make) -> None:
        """A 401 stops the run at once and records nothing (the item stays pending)."""
        setup = make()
        error = RolloutProtocolError("401", status_code=401)
        setup.recorder.record_exception((0, 0), "r1", error, latency_sec=0.1, phase="result")
        assert setup.control.stop.is_set()
        assert setup.control.reason is not None
        assert "401" in setup.control.reason
        assert setup.outcomes() == []


class TestStopRule:
    def test_consecutive_infra_failures_stop_the_run(self, make) -> None:
        """The limit-th infrastructure failure in a row asks the run to stop, saying why."""
        setup = make(limit=2)
        setup.recorder.record_result(
            (0, 0), "a", lease_expired("a"), latency_sec=1.0, cancel_requested=False
        )
        assert not setup.control.stop.is_set()
        setup.recorder.record_result(
            (1, 0), "b", lease_expired("b"), latency_sec=1.0, cancel_requested=False
        )
        assert setup.control.stop.is_set()
        assert setup.control.reason is not None
        assert "2 consecutive infrastructure failures" in setup.control.reason
        assert setup.outcomes() == ["infra_failure", "infra_failure"]

    def test_a_scored_outcome_resets_the_count(self, make) -> None:
        """A success between two infrastructure failures keeps the run going."""
        setup = make(limit=2)
        for item, result in (
            ((0, 0), lease_expired("a")),
            ((1, 0), success("b", 1.0)),
            ((2, 0), lease_expired("c")),
        ):
            setup.recorder.record_result(
                item, result.rollout_id, result, latency_sec=1.0, cancel_requested=False
            )
        assert not setup.control.stop.is_set()

    def test_zero_never_stops(self, make) -> None:
        """With a limit of 0 no number of infrastructure failures stops the run."""
        setup = make(limit=0)
        for index in range(5):
            rid = f"r{index}"
            setup.recorder.record_result(
                (index, 0), rid, lease_expired(rid), latency_sec=1.0, cancel_requested=False
            )
        assert not setup.control.stop.is_set()
        assert setup.recorder.consecutive_infra == 5

    def test_cancel_by_the_server_counts_but_is_not_recorded(self, make) -> None:
        """A rollout cancelled by someone else counts toward the rule and stays pending; one
        this run cancelled counts for nothing."""
        setup = make()
        cancelled = RolloutResultResponse(rollout_id="a", status="cancelled")
        setup.recorder.record_result((0, 0), "a", cancelled, latency_sec=1.0, cancel_requested=True)
        assert setup.recorder.consecutive_infra == 0
        setup.recorder.record_result(
            (0, 0), "a", cancelled, latency_sec=1.0, cancel_requested=False
        )
        assert setup.recorder.consecutive_infra == 1
        assert "was cancelled by the server" in setup.stream.getvalue()
        assert setup.outcomes() == []
