"""``POST /rollout/cancel``: selectors, dispositions, idempotency, backend-first cancellation."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from rollout_server import ExecutionOutcome, ExecutionResult
from rollout_types import CancelRolloutsRequest, RolloutInitRequest, RolloutStatus, structure_wire

EVENT_SEC = 10.0
ONE_SELECTOR = {"detail": "pass exactly one selector: ids, prefix, or all"}


def cancelled_outcome() -> ExecutionOutcome:
    """What a backend that turns cancellation into its own result returns."""
    return ExecutionOutcome(workflow=ExecutionResult(status=RolloutStatus.CANCELLED))


class TestSelectors:
    @pytest.mark.parametrize(
        "body",
        [
            {},
            {"ids": None, "prefix": None, "all": False},
            {"ids": ["a"], "prefix": "a"},
            {"ids": [], "all": True},
            {"prefix": "", "all": True},
            {"ids": ["a"], "prefix": "", "all": True},
        ],
    )
    async def test_not_exactly_one_selector_is_422_with_a_string_detail(
        self, harness: Any, body: dict[str, Any]
    ) -> None:
        """Zero or several active selectors give 422 with the protocol's string detail."""
        reply = await harness.cancel(body)
        assert (reply.status, reply.json) == (422, ONE_SELECTOR)

    async def test_explicit_nulls_and_false_count_as_absent(self, harness: Any) -> None:
        """The osmosis client's {"ids": [id], "prefix": null, "all": false} is one selector."""
        reply = await harness.cancel({"ids": ["nope"], "prefix": None, "all": False})
        assert (reply.status, reply.json) == (200, {"dispositions": {"nope": "not_found"}})

    async def test_empty_ids_is_a_selector_with_no_dispositions(self, harness: Any) -> None:
        """{"ids": []} is active and answers an empty mapping."""
        reply = await harness.cancel({"ids": []})
        assert (reply.status, reply.json) == (200, {"dispositions": {}})

    @pytest.mark.parametrize(
        ("body", "error_type"),
        [({"ids": "x"}, "list_type"), ({"ids": [1]}, "string_type"), ({"all": "maybe"}, None)],
    )
    async def test_wrong_json_types_are_422_lists(
        self, harness: Any, body: dict[str, Any], error_type: str | None
    ) -> None:
        """A selector of the wrong JSON type gets a 422 validation list under body."""
        reply = await harness.cancel(body)
        assert reply.status == 422
        (error, *_) = reply.json["detail"]
        assert error["loc"][0] == "body"
        if error_type is not None:
            assert error["type"] == error_type

    async def test_invalid_json_is_422(self, harness: Any) -> None:
        """An undecodable cancel body gets 422 json_invalid."""
        reply = await harness.request("POST", "/rollout/cancel", data=b"{")
        assert reply.status == 422
        assert reply.json["detail"][0]["type"] == "json_invalid"

    async def test_ids_keep_order_and_duplicates_collapse(self, harness: Any) -> None:
        """Every listed id appears once, in order, unknown ones as not_found."""
        await harness.admit("b")
        await harness.backend.started("b")
        reply = await harness.cancel({"ids": ["z", "b", "z", "a"]})
        assert list(reply.json["dispositions"].items()) == [
            ("z", "not_found"),
            ("b", "cancelled_running"),
            ("a", "not_found"),
        ]

    async def test_prefix_selects_held_ids_and_empty_prefix_selects_all(self, harness: Any) -> None:
        """A prefix selects the ids it starts; "" selects every live rollout."""
        for rollout_id in ("job-1", "job-2", "other"):
            await harness.admit(rollout_id)
            await harness.backend.started(rollout_id)
        reply = await harness.cancel({"prefix": "job-"})
        assert reply.json["dispositions"] == {
            "job-1": "cancelled_running",
            "job-2": "cancelled_running",
        }
        reply = await harness.cancel({"prefix": ""})
        assert reply.json["dispositions"]["other"] == "cancelled_running"
        assert set(reply.json["dispositions"]) == {"job-1", "job-2", "other"}

    async def test_all_lists_retained_finished_ids_as_not_found(self, harness: Any) -> None:
        """{"all": true} covers live rollouts and retained finished ones (as not_found)."""
        done = await harness.admit("done")
        (await harness.backend.started("done")).succeed()
        await harness.poll_until("done", done, "success")
        await harness.admit("live")
        await harness.backend.started("live")
        reply = await harness.cancel({"all": True})
        assert reply.json == {"dispositions": {"done": "not_found", "live": "cancelled_running"}}


class TestDispositions:
    async def test_running_rollout_is_cancelled_mid_execution(self, harness: Any) -> None:
        """Cancelling running work gives cancelled_running; the result is cancelled with
        err_message "cancelled" (the server cancelled its own task)."""
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        reply = await harness.cancel({"ids": ["r1"]})
        assert reply.json == {"dispositions": {"r1": "cancelled_running"}}
        assert harness.backend.cancel_calls == [["r1"]]
        result = await harness.poll_until("r1", token, "cancelled")
        assert result.json == {
            "rollout_id": "r1",
            "status": "cancelled",
            "sample": None,
            "err_message": "cancelled",
            "err_category": None,
        }
        assert run.cancel_seen.is_set()

    async def test_queued_rollout_is_cancelled_queued(
        self, make_harness: Any, queue_reporting: Any
    ) -> None:
        """A rollout whose backend still reports it queued gets cancelled_queued."""
        harness = await make_harness(backend=queue_reporting())
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        reply = await harness.cancel({"ids": ["r1"]})
        assert reply.json == {"dispositions": {"r1": "cancelled_queued"}}
        assert (await harness.poll_until("r1", token, "cancelled")).json["status"] == "cancelled"

    async def test_grading_counts_as_running(self, make_harness: Any, queue_reporting: Any) -> None:
        """A rollout being graded is cancelled_running, and its result is cancelled."""
        harness = await make_harness(backend=queue_reporting())
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        run.status(RolloutStatus.GRADING)
        reply = await harness.cancel({"ids": ["r1"]})
        assert reply.json == {"dispositions": {"r1": "cancelled_running"}}
        result = await harness.poll_until("r1", token, "cancelled")
        assert result.json["err_message"] == "cancelled"

    async def test_cancel_before_the_task_starts_gives_a_null_message(self, harness: Any) -> None:
        """A cancellation that lands before the execution task runs gives cancelled_queued
        and a cancelled result with err_message null; execute() is never called."""
        init = structure_wire(
            {"initial_messages": [], "rollout_id": "r1", "chat_completions_url": ""},
            RolloutInitRequest,
        )
        token = await harness.server.admit(init)  # nothing awaited before the cancel
        dispositions = await harness.server.cancel(CancelRolloutsRequest(ids=["r1"]))
        assert dispositions == {"r1": "cancelled_queued"}
        result = await harness.poll_until("r1", token, "cancelled")
        assert (result.json["err_message"], result.json["err_category"]) == (None, None)
        assert "r1" not in harness.backend.runs

    async def test_finished_and_unknown_ids_are_not_found(self, harness: Any) -> None:
        """A finished rollout and an id never admitted are both not_found."""
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        await harness.poll_until("r1", token, "success")
        reply = await harness.cancel({"ids": ["r1", "ghost"]})
        assert reply.json == {"dispositions": {"r1": "not_found", "ghost": "not_found"}}
        assert harness.backend.cancel_calls == []

    async def test_repeat_before_publication_returns_the_first_disposition(
        self, make_harness: Any, scripted: Any
    ) -> None:
        """Cancel is idempotent: while the result is unpublished (the work ignores
        cancellation), a repeat returns the first disposition without asking again."""
        harness = await make_harness(backend=scripted(ignore_cancel=True))
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        first = await harness.cancel({"ids": ["r1"]})
        async with asyncio.timeout(EVENT_SEC):
            await run.cancel_seen.wait()
        again = await harness.cancel({"ids": ["r1"]})
        assert first.json == again.json == {"dispositions": {"r1": "cancelled_running"}}
        assert harness.backend.cancel_calls == [["r1"]]
        assert run.cancels_seen == 1
        run.finish(cancelled_outcome())
        await harness.poll_until("r1", token, "cancelled")
        after = await harness.cancel({"ids": ["r1"]})
        assert after.json == {"dispositions": {"r1": "not_found"}}

    async def test_cancel_is_logged_with_the_count(self, harness: Any, caplog: Any) -> None:
        """Each cancel request logs how many rollouts it cancelled and its selector."""
        await harness.admit("r1")
        await harness.backend.started("r1")
        with caplog.at_level(logging.INFO, logger="rollout_server.app"):
            await harness.cancel({"all": True})
        assert "Cancelled 1 rollout(s) (all)" in caplog.messages


class TestBackendFirst:
    @pytest.mark.parametrize("answer", ["cancelled_running", "cancelled_queued"])
    async def test_backend_disposition_is_adopted_and_the_task_left_alone(
        self, harness: Any, answer: str
    ) -> None:
        """When the backend cancels the work itself, its disposition is returned, the
        server's task is not cancelled, and the backend's own result is published."""
        harness.backend.cancel_answers = {"r1": answer}
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        reply = await harness.cancel({"ids": ["r1"]})
        assert reply.json == {"dispositions": {"r1": answer}}
        assert not run.cancel_seen.is_set()
        run.finish(cancelled_outcome())
        result = await harness.poll_until("r1", token, "cancelled")
        assert result.json["err_message"] is None
        assert not run.cancel_seen.is_set()

    async def test_backend_not_found_with_retained_terminal_state_is_adopted(
        self, harness: Any
    ) -> None:
        """not_found from a backend that retains the id's terminal state is adopted as is."""
        harness.backend.cancel_answers = {"r1": "not_found"}
        harness.backend.retained = {"r1": {"status": "success"}}
        await harness.admit("r1")
        run = await harness.backend.started("r1")
        reply = await harness.cancel({"ids": ["r1"]})
        assert reply.json == {"dispositions": {"r1": "not_found"}}
        assert not run.cancel_seen.is_set()

    @pytest.mark.parametrize(
        "answers",
        [
            {"r1": "not_found"},
            {},
            {"r1": "something-else"},
            ["not", "a", "dict"],
            RuntimeError("backend down"),
        ],
        ids=["unknown-to-backend", "unsupported", "bad-value", "not-a-dict", "raises"],
    )
    async def test_server_task_is_the_fallback(self, harness: Any, answers: Any) -> None:
        """When the backend does not handle the id (not_found without retained state, {},
        a bad answer, or an exception), the server cancels its own task."""
        harness.backend.cancel_answers = answers
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        reply = await harness.cancel({"ids": ["r1"]})
        assert reply.json == {"dispositions": {"r1": "cancelled_running"}}
        async with asyncio.timeout(EVENT_SEC):
            await run.cancel_seen.wait()
        result = await harness.poll_until("r1", token, "cancelled")
        assert result.json["err_message"] == "cancelled"
