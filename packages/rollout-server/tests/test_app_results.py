"""``GET /rollout/{rollout_id}/result``: checks, long-poll semantics and the wire sample."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import pytest

from rollout_server import ExecutionOutcome, ExecutionResult, Sample
from rollout_server.state._deadlines import due_at
from rollout_types import (
    LEASE_HEADER,
    RolloutErrorCategory,
    RolloutResultResponse,
    RolloutStatus,
    dumps,
)

EVENT_SEC = 10.0


def in_progress(rollout_id: str, status: str) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "status": status,
        "sample": None,
        "err_message": None,
        "err_category": None,
    }


class TestResultChecks:
    async def test_missing_lease_header_is_422(self, harness: Any) -> None:
        """A poll without the lease header gets 422 missing at header.X-Osmosis-Rollout-Lease."""
        await harness.admit("r1")
        reply = await harness.poll("r1", None)
        assert reply.status == 422
        assert reply.json == {
            "detail": [
                {
                    "type": "missing",
                    "loc": ["header", LEASE_HEADER],
                    "msg": "Field required",
                    "input": None,
                }
            ]
        }

    async def test_empty_lease_header_is_string_too_short(self, harness: Any) -> None:
        """An empty lease header gets 422 string_too_short with min_length 1."""
        await harness.admit("r1")
        reply = await harness.poll("r1", "")
        assert reply.status == 422
        (error,) = reply.json["detail"]
        assert (error["type"], error["ctx"]) == ("string_too_short", {"min_length": 1})
        assert error["loc"] == ["header", LEASE_HEADER]

    async def test_unknown_id_is_404_whatever_the_token(self, harness: Any) -> None:
        """An id never admitted gets 404 unknown rollout_id."""
        token = await harness.admit("r1")
        for presented in (token, "nonsense"):
            reply = await harness.poll("nope", presented)
            assert reply.status == 404
            assert reply.json == {"detail": "unknown rollout_id"}

    async def test_wrong_token_is_403(self, harness: Any) -> None:
        """A known id with a wrong token gets 403 invalid polling lease."""
        await harness.admit("r1")
        reply = await harness.poll("r1", "x" * 43)
        assert reply.status == 403
        assert reply.json == {"detail": "invalid polling lease"}

    async def test_wrong_token_is_403_after_the_result_is_final(self, harness: Any) -> None:
        """The token is still checked once the result is published."""
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        await harness.poll_until("r1", token, "success")
        assert (await harness.poll("r1", token[:-1])).status == 403

    async def test_another_rollouts_token_is_403(self, harness: Any) -> None:
        """A token is bound to its rollout."""
        await harness.admit("r1")
        other = await harness.admit("r2")
        assert (await harness.poll("r1", other)).status == 403


class TestLongPoll:
    async def test_in_progress_body_has_every_key_null(self, harness: Any) -> None:
        """While running, a poll that times out answers the current status and null fields."""
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        reply = await harness.poll("r1", token)
        assert reply.status == 200
        assert reply.json == in_progress("r1", "running")
        assert (
            reply.raw
            == dumps(RolloutResultResponse(rollout_id="r1", status=RolloutStatus.RUNNING)).encode()
        )

    async def test_times_out_after_the_wait_with_the_current_status(self, harness: Any) -> None:
        """With no status change, the poll answers after result_wait_timeout_sec (0.3 s)."""
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        started = time.monotonic()
        reply = await harness.poll("r1", token)
        assert time.monotonic() - started >= 0.25
        assert reply.json["status"] == "running"

    async def test_wakes_on_each_status_change(
        self, make_harness: Any, queue_reporting: Any
    ) -> None:
        """With a 30 s wait and no status-change grace (osmosis-ai's timing), each poll
        returns as soon as the status changes: queued → running → grading → success."""
        harness = await make_harness(
            backend=queue_reporting(),
            result_wait_timeout_sec=30.0,
            polling_lease_timeout_sec=60.0,
            status_change_grace_sec=0.0,
        )
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            steps: list[tuple[Callable[[], None], str]] = [
                (lambda: run.status(RolloutStatus.RUNNING), "running"),
                (lambda: run.status(RolloutStatus.GRADING), "grading"),
                (lambda: run.succeed(0.5), "success"),
            ]
            for change, expected in steps:
                poll = asyncio.create_task(harness.poll("r1", token))
                await _until_waiting(harness, "r1")
                change()
                reply = await poll
                assert reply.json["status"] == expected
        assert reply.json["sample"]["reward"] == 0.5

    @staticmethod
    async def _grading_begins_under_a_poll(
        make_harness: Any, queue_reporting: Any, grace_sec: float
    ) -> tuple[Any, Any, asyncio.Task[Any]]:
        """Admit r1, let a poll wait in ``running`` (30 s wait), then start grading;
        return the harness, the run and the poll's task."""
        harness = await make_harness(
            backend=queue_reporting(),
            result_wait_timeout_sec=30.0,
            polling_lease_timeout_sec=60.0,
            status_change_grace_sec=grace_sec,
        )
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        run.status(RolloutStatus.RUNNING)
        poll = asyncio.create_task(harness.poll("r1", token))
        await _until_waiting(harness, "r1")
        run.status(RolloutStatus.GRADING)
        return harness, run, poll

    async def test_a_change_ends_the_wait_within_the_grace(
        self, make_harness: Any, queue_reporting: Any
    ) -> None:
        """With a 30 s wait and a 0.2 s grace, a poll woken by running → grading answers
        ``grading`` long before its wait is over."""
        _harness, run, poll = await self._grading_begins_under_a_poll(
            make_harness, queue_reporting, 0.2
        )
        async with asyncio.timeout(EVENT_SEC):
            reply = await poll
        assert reply.json["status"] == "grading"
        assert reply.json["sample"] is None
        run.succeed(0.5)

    async def test_a_result_within_the_grace_is_answered_instead_of_the_change(
        self, make_harness: Any, queue_reporting: Any
    ) -> None:
        """A poll waiting in ``running`` sees grading begin, and the result follows within
        the grace: that one poll answers the result (one round trip instead of two)."""
        harness, run, poll = await self._grading_begins_under_a_poll(
            make_harness, queue_reporting, EVENT_SEC
        )
        await asyncio.sleep(0.2)  # without the grace, the poll would answer ``grading`` now
        assert not poll.done()
        assert harness.server.registry.get("r1").status is RolloutStatus.GRADING
        run.succeed(0.5)
        async with asyncio.timeout(EVENT_SEC):
            reply = await poll
        assert reply.json["status"] == "success"
        assert reply.json["sample"]["reward"] == 0.5

    @pytest.mark.parametrize("reported_by", ["server", "backend"])
    async def test_change_between_polls_is_answered_within_the_grace(
        self, make_harness: Any, queue_reporting: Any, reported_by: str
    ) -> None:
        """Running reported between polls (by the server as the execution starts, before
        the first poll arrives, or later by the backend) is answered by the next poll
        within the grace while the execution is still held, not after its 30 s wait (the
        admission answered queued)."""
        backend = queue_reporting() if reported_by == "backend" else None
        harness = await make_harness(
            backend=backend, result_wait_timeout_sec=30.0, polling_lease_timeout_sec=60.0
        )
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        if reported_by == "backend":
            run.status(RolloutStatus.RUNNING)  # between polls: nobody is waiting
        assert harness.server.registry.get("r1").status is RolloutStatus.RUNNING
        async with asyncio.timeout(EVENT_SEC):
            reply = await harness.poll("r1", token)
        assert reply.json == in_progress("r1", "running")
        assert not run.finished.is_set()
        run.succeed(0.5)

    async def test_the_admission_answer_counts_as_delivered(
        self, make_harness: Any, queue_reporting: Any
    ) -> None:
        """While the status is still the queued the admission answered, a poll waits for
        a change up to its whole wait (no grace), and answers the change within the
        grace."""
        harness = await make_harness(
            backend=queue_reporting(), result_wait_timeout_sec=30.0, polling_lease_timeout_sec=60.0
        )
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        record = harness.server.registry.get("r1")
        before = asyncio.get_running_loop().time()
        async with asyncio.timeout(EVENT_SEC):
            poll = asyncio.create_task(harness.poll("r1", token))
            await _until_waiting(harness, "r1")
            assert _poll_deadline(record) >= before + 30.0
            run.status(RolloutStatus.RUNNING)
            reply = await poll
        assert reply.json == in_progress("r1", "running")
        run.succeed(0.5)

    async def test_a_status_answered_is_not_answered_again_before_a_change(
        self, make_harness: Any
    ) -> None:
        """After a poll answered running, the next poll waits for the next change (its
        whole wait), then answers grading."""
        harness = await make_harness(result_wait_timeout_sec=30.0, polling_lease_timeout_sec=60.0)
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        record = harness.server.registry.get("r1")
        async with asyncio.timeout(EVENT_SEC):
            assert (await harness.poll("r1", token)).json["status"] == "running"
            before = asyncio.get_running_loop().time()
            poll = asyncio.create_task(harness.poll("r1", token))
            await _until_waiting(harness, "r1")
            assert _poll_deadline(record) >= before + 30.0
            run.status(RolloutStatus.GRADING)
            reply = await poll
        assert reply.json == in_progress("r1", "grading")
        run.succeed(0.5)

    async def test_a_quick_rollout_is_answered_in_one_round_trip(self, make_harness: Any) -> None:
        """A poll that finds running not yet answered, whose rollout then finishes within
        the grace, answers the result itself (not running, then the result)."""
        harness = await make_harness(
            result_wait_timeout_sec=30.0,
            polling_lease_timeout_sec=60.0,
            status_change_grace_sec=EVENT_SEC,
        )
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            poll = asyncio.create_task(harness.poll("r1", token))
            await _until_waiting(harness, "r1")
            run.succeed(0.5)
            reply = await poll
        assert reply.json["status"] == "success"
        assert reply.json["sample"]["reward"] == 0.5

    async def test_published_result_is_answered_at_once(self, make_harness: Any) -> None:
        """A poll on a finished rollout returns the result without waiting (wait is 30 s)."""
        harness = await make_harness(result_wait_timeout_sec=30.0, polling_lease_timeout_sec=60.0)
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        async with asyncio.timeout(EVENT_SEC):
            await harness.poll_until("r1", token, "success")
            for _ in range(3):
                assert (await harness.poll("r1", token)).json["status"] == "success"

    async def test_concurrent_polls_all_wake(self, make_harness: Any) -> None:
        """Several polls with the same token may wait at once; all wake on the change."""
        harness = await make_harness(result_wait_timeout_sec=30.0, polling_lease_timeout_sec=60.0)
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            polls = [asyncio.create_task(harness.poll("r1", token)) for _ in range(3)]
            await _until_waiting(harness, "r1", count=3)
            run.succeed()
            replies = await asyncio.gather(*polls)
        assert [r.json["status"] for r in replies] == ["success"] * 3

    @pytest.mark.parametrize(
        ("rollout_id", "path_segment"),
        [
            ("a b", "a%20b"),
            ("a?b", "a%3Fb"),
            ("a#b", "a%23b"),
            ("50%", "50%25"),
            ("ünï", "%C3%BCn%C3%AF"),
            ("{x}", "%7Bx%7D"),
            ("a:b.c-d_e", "a:b.c-d_e"),
        ],
    )
    async def test_id_in_the_path_is_percent_decoded(
        self, harness: Any, rollout_id: str, path_segment: str
    ) -> None:
        """A percent-encoded path segment reaches the rollout of the decoded id."""
        token = await harness.admit(rollout_id)
        (await harness.backend.started(rollout_id)).succeed()
        async with asyncio.timeout(EVENT_SEC):
            while True:
                reply = await harness.request(
                    "GET", f"/rollout/{path_segment}/result", headers={LEASE_HEADER: token}
                )
                assert reply.status == 200, reply
                if reply.json["status"] == "success":
                    break
        assert reply.json["rollout_id"] == rollout_id


def _poll_deadline(record: Any) -> float:
    """The loop time the one waiting poll of ``record`` is due at (its grace or its wait)."""
    entry = record.poll_entries
    assert isinstance(entry, list)
    return due_at(entry)


async def _until_waiting(harness: Any, rollout_id: str, count: int = 1) -> None:
    """Yield until ``count`` long polls of ``rollout_id`` are waiting in the registry."""
    record = harness.server.registry.get(rollout_id)
    await harness.until(lambda: record.waiting >= count)


class TestWireResult:
    async def _result(self, harness: Any, outcome: Any, **admit: Any) -> dict[str, Any]:
        token = await harness.admit("r1", **admit)
        run = await harness.backend.started("r1")
        run.finish(outcome)
        reply = await harness.poll_until("r1", token, "success", "failure", "cancelled")
        result: dict[str, Any] = reply.json
        return result

    async def test_success_carries_the_reward(self, harness: Any, outcome_success: Any) -> None:
        """A kept, successful sample carries its numeric reward and all six sample keys."""
        result = await self._result(harness, outcome_success(0.75, label="L", metrics={"m": 1}))
        assert result == {
            "rollout_id": "r1",
            "status": "success",
            "sample": {
                "messages": [{"role": "assistant", "content": "hi"}],
                "label": "L",
                "reward": 0.75,
                "remove_sample": False,
                "metrics": {"m": 1},
                "extra_fields": {},
            },
            "err_message": None,
            "err_category": None,
        }

    async def test_trajectory_messages_never_appear(
        self, harness: Any, outcome_success: Any
    ) -> None:
        """The persistence-only trajectory_messages is not sent."""
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).finish(
            outcome_success(0.5, trajectory_messages=[{"role": "system", "content": "t"}])
        )
        reply = await harness.poll_until("r1", token, "success")
        assert b"trajectory_messages" not in reply.raw
        assert "trajectory_messages" not in reply.json["sample"]

    async def test_remove_sample_nulls_the_reward(self, harness: Any, outcome_success: Any) -> None:
        """A successful sample with remove_sample has reward null on the wire."""
        result = await self._result(harness, outcome_success(0.7, remove_sample=True))
        assert result["status"] == "success"
        assert result["sample"]["remove_sample"] is True
        assert result["sample"]["reward"] is None

    async def test_failure_nulls_the_reward(self, harness: Any) -> None:
        """A failed rollout never carries a numeric reward (e.g. a grader timeout after a
        reward was set)."""
        sample = Sample(messages=[], reward=0.9)
        outcome = ExecutionOutcome(
            workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample),
            grader=ExecutionResult(
                status=RolloutStatus.FAILURE,
                sample=sample,
                err_message="grader exceeded its 0.5s deadline",
                err_category=RolloutErrorCategory.TIMEOUT,
            ),
        )
        result = await self._result(harness, outcome)
        assert (result["status"], result["err_category"]) == ("failure", "timeout")
        assert result["err_message"] == "grader exceeded its 0.5s deadline"
        assert result["sample"]["reward"] is None

    async def test_non_json_metrics_are_dropped_and_reward_kept(self, harness: Any) -> None:
        """NaN and objects in metrics/extra_fields are dropped; the reward survives."""
        sample = Sample(
            messages=[],
            reward=0.5,
            metrics={"bad": math.nan, "obj": object(), "ok": 1.5, 3: "three"},  # type: ignore[dict-item]
            extra_fields={"t": (1, 2), "inf": math.inf},
        )
        outcome = ExecutionOutcome(
            workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample)
        )
        result = await self._result(harness, outcome)
        assert result["sample"]["metrics"] == {"ok": 1.5, "3": "three"}
        assert result["sample"]["extra_fields"] == {"t": [1, 2]}
        assert result["sample"]["reward"] == 0.5

    async def test_non_json_messages_give_a_minimal_sample(self, harness: Any) -> None:
        """A message holding a non-JSON object turns into messages: [] with the reward kept."""
        sample = Sample(
            messages=[{"role": "assistant", "content": object()}], label="L", reward=0.5
        )
        outcome = ExecutionOutcome(
            workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample)
        )
        result = await self._result(harness, outcome)
        assert result["sample"] == {
            "messages": [],
            "label": "L",
            "reward": 0.5,
            "remove_sample": False,
            "metrics": {},
            "extra_fields": {},
        }

    async def test_non_finite_reward_is_null(self, harness: Any) -> None:
        """A NaN reward cannot go on the wire: it is sent as null."""
        outcome = ExecutionOutcome(
            workflow=ExecutionResult(
                status=RolloutStatus.SUCCESS, sample=Sample(messages=[], reward=math.nan)
            )
        )
        result = await self._result(harness, outcome)
        assert result["sample"]["reward"] is None

    async def test_ungraded_success_keeps_a_null_reward(self, harness: Any) -> None:
        """grade=false with a successful workflow: success, the workflow sample, reward null."""
        outcome = ExecutionOutcome(
            workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=Sample(messages=[]))
        )
        result = await self._result(harness, outcome, grade=False)
        assert result["status"] == "success"
        assert result["sample"]["reward"] is None

    async def test_err_message_surrogates_are_replaced(self, harness: Any) -> None:
        """A lone surrogate in err_message is replaced so the body is valid UTF-8."""
        outcome = ExecutionOutcome(
            workflow=ExecutionResult(
                status=RolloutStatus.FAILURE,
                err_message="bad \ud800 byte",
                err_category=RolloutErrorCategory.AGENT_ERROR,
            )
        )
        result = await self._result(harness, outcome)
        assert result["err_message"] == "bad ? byte"
