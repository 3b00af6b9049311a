"""What each ending of a work item means (``_outcomes``), and the concurrency choice."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from rollout_client import (
    RolloutAdmissionTimeoutError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from rollout_client.eval import EvalOptions
from rollout_client.eval._outcomes import (
    classify_exception,
    deadline_exceeded,
    passes,
    run_stopping_reason,
)
from rollout_client.eval._probe import choose_concurrency


class TestClassifyException:
    @pytest.mark.parametrize(
        ("exc", "category"),
        [
            (
                RolloutAdmissionTimeoutError("late", rollout_id="r", may_have_succeeded=False),
                "admission_timeout",
            ),
            (RolloutProtocolError("POST /rollout returned 409", status_code=409), "protocol_error"),
            (aiohttp.ServerDisconnectedError(), "transport_error"),
            (ConnectionRefusedError("refused"), "transport_error"),
            (TimeoutError(), "transport_error"),
            (ValueError("bad"), "client_error"),
        ],
    )
    def test_category(self, exc: Exception, category: str) -> None:
        """Each kind of failure is an infra_failure with its client-side category."""
        classified = classify_exception(exc, phase="admission")
        assert classified.outcome == "infra_failure"
        assert classified.err_category == category
        assert classified.reward is None

    def test_message_names_phase_and_type(self) -> None:
        """The message is 'phase: Type: text', or 'phase: Type' when the text is empty."""
        error = RolloutProtocolError("GET /rollout/r/result returned 500", status_code=500)
        assert classify_exception(error, phase="result").err_message == (
            "result: RolloutProtocolError: GET /rollout/r/result returned 500"
        )
        assert classify_exception(TimeoutError(), phase="result").err_message == (
            "result: TimeoutError"
        )


class TestRunStoppingReason:
    def test_protocol_version_stops_the_run(self) -> None:
        """Another protocol version stops the run, quoting the client's error."""
        error = RolloutProtocolVersionError(
            "speaks 2.0", status_code=200, client_version="1.0", server_version="2.0"
        )
        reason = run_stopping_reason(error, phase="admission")
        assert reason is not None
        assert "another protocol version: speaks 2.0" in reason

    def test_refused_key_stops_the_run(self) -> None:
        """A 401 stops the run and says which phase and which flag."""
        reason = run_stopping_reason(RolloutProtocolError("401", status_code=401), phase="result")
        assert reason is not None
        assert "(401) during result" in reason
        assert "--server-api-key-env" in reason

    @pytest.mark.parametrize(
        "exc",
        [
            RolloutProtocolError("500", status_code=500),
            aiohttp.ServerDisconnectedError(),
            OSError("unreachable"),
        ],
    )
    def test_other_failures_do_not(self, exc: Exception) -> None:
        """Other failures are recorded per item, never a reason to stop everything."""
        assert run_stopping_reason(exc, phase="admission") is None


class TestDeadlineAndPasses:
    def test_deadline_exceeded(self) -> None:
        """An overrun is an infra_failure naming the deadline and the flag that raises it."""
        classified = deadline_exceeded(90.0)
        assert classified.outcome == "infra_failure"
        assert classified.err_category == "deadline_exceeded"
        assert classified.err_message is not None
        assert "no result within 90 s" in classified.err_message
        assert "--item-deadline-sec" in classified.err_message

    @pytest.mark.parametrize(
        ("outcome", "reward", "expected"),
        [
            ("success", 1.0, True),
            ("success", 0.5, False),
            ("success", None, False),
            ("failed", 1.0, False),
            ("skipped", None, False),
            ("infra_failure", None, False),
        ],
    )
    def test_passes(self, outcome: str, reward: float | None, expected: bool) -> None:
        """Only a success whose reward reaches the threshold (1.0 here) passes."""
        assert passes(outcome, reward, 1.0) is expected


class TestChooseConcurrency:
    def options(self, concurrency: int | None = None) -> EvalOptions:
        return EvalOptions(
            dataset=Path("d.jsonl"),
            server_url="http://127.0.0.1:9",
            chat_url="http://127.0.0.1:9/v1",
            concurrency=concurrency,
        )

    def test_option_wins(self) -> None:
        """--concurrency beats the server's capacity."""
        health = {"concurrency": {"max_concurrent": 8}}
        assert choose_concurrency(self.options(3), [health], pending=100) == (3, None)

    def test_server_capacity(self) -> None:
        """Without --concurrency the server's reported capacity is used."""
        health = {"concurrency": {"max_concurrent": 8}}
        assert choose_concurrency(self.options(), [health], pending=100) == (8, None)

    def test_default_without_limit_is_noted(self) -> None:
        """A server without a limit gives 32 at a time, with a note saying so."""
        concurrency, note = choose_concurrency(self.options(), [{}], pending=100)
        assert concurrency == 32
        assert note is not None
        assert "--concurrency" in note

    def test_never_more_than_pending(self) -> None:
        """No more workers than pending items."""
        assert choose_concurrency(self.options(50), [{}], pending=4) == (4, None)

    def test_servers_capacities_add_up(self) -> None:
        """Several servers' reported capacities add up to the default concurrency."""
        healths = [{"concurrency": {"max_concurrent": 8}}, {"max_queue_depth": 3}]
        assert choose_concurrency(self.options(), healths, pending=100) == (11, None)

    def test_one_server_without_limit_gives_the_default(self) -> None:
        """When one of several servers reports no capacity, 32 at a time, with a note."""
        healths = [{"concurrency": {"max_concurrent": 8}}, {}]
        concurrency, note = choose_concurrency(self.options(), healths, pending=100)
        assert concurrency == 32
        assert note is not None
        assert "a server reports no concurrency limit" in note
