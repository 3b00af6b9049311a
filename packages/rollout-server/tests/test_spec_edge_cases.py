"""Edge cases of wire-protocol section 9 that the other server suites leave unproven.

Each class names the section 9 item it pins down; ``tests/SPEC_COVERAGE.md`` maps every
item to its tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
)
from rollout_types import RolloutStatus

EVENT_SEC = 10.0
"""Upper bound on waiting for an event a test expects (never reached when all is well)."""

TERMINAL = ("success", "failure", "cancelled")
ANSWER = {"role": "assistant", "content": "42"}


def in_progress(rollout_id: str, status: str) -> dict[str, Any]:
    """The body of a result poll while the rollout is not finished."""
    return {
        "rollout_id": rollout_id,
        "status": status,
        "sample": None,
        "err_message": None,
        "err_category": None,
    }


async def until_waiting(harness: Any, rollout_id: str) -> None:
    """Yield until one long poll of ``rollout_id`` waits in the registry (bounded)."""
    record = harness.server.registry.get(rollout_id)
    await harness.until(lambda: record.waiting >= 1)


class TestItem04ValidationBeforeDuplicate:
    async def test_invalid_body_with_a_live_id_on_a_full_server_is_422(
        self, harness: Any, body: Any
    ) -> None:
        """An invalid body whose id is live, sent to a full server, gets 422 (not 429/409)."""
        await harness.admit("r1")
        harness.backend.capacity = False
        reply = await harness.post_rollout(body("r1", llm_api_key=""))
        assert reply.status == 422
        assert [e["loc"] for e in reply.json["detail"]] == [["body", "llm_api_key"]]
        harness.backend.capacity = True
        reply = await harness.post_rollout(body("r1", agent_timeout_sec="soon"))
        assert reply.status == 422
        assert reply.json["detail"][0]["loc"] == ["body", "agent_timeout_sec"]


class TestItem10CallbackKeys:
    async def test_callback_keys_with_null_values_are_ignored(
        self, harness: Any, body: Any
    ) -> None:
        """The pre-0.3.3 keys sent as null alongside a full pull body are ignored: 202."""
        reply = await harness.post_rollout(
            body(
                "r1",
                completion_callback_url=None,
                grader_callback_url=None,
                controller_api_key=None,
            )
        )
        assert reply.status == 202

    async def test_full_body_with_a_callback_url_gets_400(self, harness: Any, body: Any) -> None:
        """Deliberately better than osmosis: a valid pull body that also names a
        completion_callback_url gets 400 saying to upgrade together, and nothing runs."""
        reply = await harness.post_rollout(
            body("r1", completion_callback_url="http://caller/done", controller_api_key="k")
        )
        assert reply.status == 400
        assert "upgrade" in reply.json["detail"]
        assert harness.server.registry.get("r1") is None
        assert "r1" not in harness.backend.runs


class TestItem14WakeBody:
    async def test_woken_poll_answers_the_new_status_with_null_fields(
        self, make_harness: Any, queue_reporting: Any
    ) -> None:
        """A long poll woken by queued -> running answers running with sample, err_message
        and err_category all null (the 30 s wait proves it woke early)."""
        harness = await make_harness(
            backend=queue_reporting(), result_wait_timeout_sec=30.0, polling_lease_timeout_sec=60.0
        )
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            poll = asyncio.create_task(harness.poll("r1", token))
            await until_waiting(harness, "r1")
            run.status(RolloutStatus.RUNNING)
            reply = await poll
        assert reply.status == 200
        assert reply.json == in_progress("r1", "running")


class TestItem15ChangeBetweenPolls:
    async def test_change_between_polls_shows_once_the_wait_elapses(
        self, make_harness: Any, queue_reporting: Any
    ) -> None:
        """With no further change, a status set between polls is answered when the next
        poll's wait (0.3 s) elapses, when that is shorter than the grace (1 s)."""
        harness = await make_harness(backend=queue_reporting(), result_wait_timeout_sec=0.3)
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        run.status(RolloutStatus.RUNNING)
        run.status(RolloutStatus.GRADING)  # between polls: nobody is waiting
        reply = await harness.poll("r1", token)
        assert reply.json == in_progress("r1", "grading")


# -- LocalBackend over HTTP ----------------------------------------------------------------

GATES: dict[str, asyncio.Event] = {}


def gate(key: str) -> asyncio.Event:
    return GATES.setdefault(key, asyncio.Event())


class GatedWorkflow(AgentWorkflow):
    """Signals ``started:<id>``, waits for the gate ``<id>``, then answers."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        gate(f"started:{ctx.rollout_id}").set()
        await gate(ctx.rollout_id).wait()
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class AnswerWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class RemoveOnlyGrader(Grader):
    """Flags the sample for removal and sets no reward."""

    calls: ClassVar[int] = 0

    async def grade(self, ctx: GraderContext) -> None:
        type(self).calls += 1
        ctx.set_remove_sample()


class GatedLocalBackend(LocalBackend):
    """A LocalBackend whose ``release_all()`` (called by ``make_harness`` at teardown) opens
    every gate, so no blocked workflow delays the shutdown."""

    def release_all(self) -> None:
        for event in GATES.values():
            event.set()


@pytest.fixture
def make_local(make_harness: Any) -> Callable[[LocalBackend], Awaitable[Any]]:
    """Factory: a harness (the conftest's route helpers) serving a LocalBackend."""
    GATES.clear()

    async def make(backend: LocalBackend) -> Any:
        return await make_harness(backend=backend)

    return make


MakeLocal = Callable[[LocalBackend], Awaitable[Any]]


class TestItem03LocalBackendQueue:
    async def test_unbounded_queue_admits_and_reports_queued(
        self, make_local: MakeLocal, body: Any, tmp_path: Path
    ) -> None:
        """Without max_queued, LocalBackend admits every rollout past its one slot (never
        429); deliberately better than osmosis, the waiting ones report queued, not running."""
        backend = GatedLocalBackend(
            GatedWorkflow,
            workflow_config=AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1}),
            artifact_root=tmp_path,
        )
        harness = await make_local(backend)
        tokens = {"a": await harness.admit("a", grade=False)}
        async with asyncio.timeout(EVENT_SEC):
            await gate("started:a").wait()
        for rollout_id in ("b", "c", "d"):
            reply = await harness.post_rollout(body(rollout_id, grade=False))
            assert reply.status == 202, reply
            tokens[rollout_id] = reply.json["polling_lease_token"]
        await harness.until(lambda: backend.health()["concurrency"]["queued"] == 3)
        health = (await harness.health()).json["concurrency"]
        assert (health["max_concurrent"], health["queued"], health["running"]) == (1, 3, 1)
        assert health.get("max_queued") is None
        replies = await asyncio.gather(*(harness.poll(rid, token) for rid, token in tokens.items()))
        assert [reply.json for reply in replies] == [
            in_progress("a", "running"),
            in_progress("b", "queued"),
            in_progress("c", "queued"),
            in_progress("d", "queued"),
        ]
        for rollout_id in ("a", "b", "c", "d"):
            gate(rollout_id).set()
        for rollout_id, token in tokens.items():
            reply = await harness.poll_until(rollout_id, token, *TERMINAL)
            assert reply.json["status"] == "success"


class TestItem36RemoveSampleWithoutReward:
    async def test_remove_sample_alone_is_a_success(
        self, make_local: MakeLocal, tmp_path: Path
    ) -> None:
        """A grader that sets remove_sample but no reward passes the reward check: success,
        remove_sample true, reward null."""
        RemoveOnlyGrader.calls = 0
        backend = GatedLocalBackend(AnswerWorkflow, grader=RemoveOnlyGrader, artifact_root=tmp_path)
        harness = await make_local(backend)
        token = await harness.admit("r1")
        reply = await harness.poll_until("r1", token, *TERMINAL)
        assert RemoveOnlyGrader.calls == 1
        assert (reply.json["status"], reply.json["err_message"], reply.json["err_category"]) == (
            "success",
            None,
            None,
        )
        sample = reply.json["sample"]
        assert (sample["remove_sample"], sample["reward"]) == (True, None)
        assert sample["messages"][-1] == ANSWER


class TestItem13FinishedPoll:
    async def test_finished_result_is_never_turned_into_lease_expired(
        self, make_harness: Any
    ) -> None:
        """Polls of a published result answer it at once even when its lease deadline has
        passed: the final result is never replaced by lease_expired."""
        harness = await make_harness(result_wait_timeout_sec=30.0, polling_lease_timeout_sec=60.0)
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        async with asyncio.timeout(EVENT_SEC):
            final = await harness.poll_until("r1", token, "success")
            record = harness.server.registry.get("r1")
            record.lease_deadline = asyncio.get_running_loop().time() - 1.0
            again = await harness.poll("r1", token)
        assert again.raw == final.raw


class TestItem06NonStringIds:
    @pytest.mark.parametrize("rollout_id", [5, 1.5, True, None, ["r1"], {"id": "r1"}])
    async def test_non_string_rollout_id_is_string_type(
        self, harness: Any, body: Any, rollout_id: Any
    ) -> None:
        """A rollout_id of any non-string JSON type gets 422 string_type, never coerced."""
        reply = await harness.post_rollout(body(rollout_id))
        assert reply.status == 422
        assert [(e["type"], e["loc"]) for e in reply.json["detail"]] == [
            ("string_type", ["body", "rollout_id"])
        ]
        assert len(harness.server.registry) == 0


class TestItem08NonFiniteGraderTimeout:
    @pytest.mark.parametrize("literal", ["NaN", "-Infinity", "1e999"])
    async def test_non_finite_grader_timeout_is_422(self, harness: Any, literal: str) -> None:
        """Deliberately better than osmosis (500): a non-finite grader_timeout_sec gets a 422
        at body.grader_timeout_sec, and nothing is admitted."""
        raw = (
            '{"initial_messages":[],"rollout_id":"r1","chat_completions_url":"",'
            f'"grader_timeout_sec":{literal}}}'
        )
        reply = await harness.request(
            "POST", "/rollout", data=raw, headers={"Content-Type": "application/json"}
        )
        assert reply.status == 422
        assert reply.json["detail"][0]["loc"] == ["body", "grader_timeout_sec"]
        assert harness.server.registry.get("r1") is None


class TestItem11HeaderBeforeLookup:
    @pytest.mark.parametrize(("token", "error_type"), [(None, "missing"), ("", "string_too_short")])
    async def test_bad_lease_header_is_422_even_for_an_unknown_id(
        self, harness: Any, token: str | None, error_type: str
    ) -> None:
        """The lease header is validated before the id is looked up: an unknown id polled
        without (or with an empty) header gets 422, not 404."""
        reply = await harness.poll("ghost", token)
        assert reply.status == 422
        (error,) = reply.json["detail"]
        assert (error["type"], error["loc"]) == (error_type, ["header", "X-Osmosis-Rollout-Lease"])


class TestItem16AuthBeforeExpiry:
    async def test_wrong_token_after_the_deadline_is_403_and_expires_nothing(
        self, harness: Any
    ) -> None:
        """A poll with a wrong token that arrives after the lease deadline gets 403 and does
        not expire the lease; the right token then gets lease_expired at once."""
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        record = harness.server.registry.get("r1")
        record.lease_deadline = asyncio.get_running_loop().time() - 1.0
        assert (await harness.poll("r1", "x" * 43)).status == 403
        assert not record.published
        assert not run.cancel_seen.is_set()
        reply = await harness.poll("r1", token)
        assert (reply.json["status"], reply.json["err_message"], reply.json["err_category"]) == (
            "failure",
            "polling lease expired",
            "lease_expired",
        )


class TestItem20ExplicitNullSelectors:
    async def test_empty_ids_with_explicit_nulls_is_one_selector(self, harness: Any) -> None:
        """{"ids": [], "prefix": null, "all": false} is one active selector: 200, empty."""
        reply = await harness.cancel({"ids": [], "prefix": None, "all": False})
        assert (reply.status, reply.json) == (200, {"dispositions": {}})

    async def test_empty_prefix_with_explicit_nulls_selects_everything(self, harness: Any) -> None:
        """{"ids": null, "prefix": "", "all": false} is one active selector matching every
        live rollout."""
        for rollout_id in ("a", "b"):
            await harness.admit(rollout_id)
            await harness.backend.started(rollout_id)
        reply = await harness.cancel({"ids": None, "prefix": "", "all": False})
        assert (reply.status, reply.json) == (
            200,
            {"dispositions": {"a": "cancelled_running", "b": "cancelled_running"}},
        )


class TestItem21EmptyPrefixAndRetained:
    async def test_empty_prefix_lists_retained_finished_ids_as_not_found(
        self, harness: Any
    ) -> None:
        """prefix "" selects every id the server holds: live ones are cancelled, retained
        finished ones are listed as not_found and keep their result."""
        done = await harness.admit("done")
        (await harness.backend.started("done")).succeed()
        await harness.poll_until("done", done, "success")
        live = await harness.admit("live")
        await harness.backend.started("live")
        reply = await harness.cancel({"prefix": ""})
        assert reply.json == {"dispositions": {"done": "not_found", "live": "cancelled_running"}}
        assert (await harness.poll("done", done)).json["status"] == "success"
        assert (await harness.poll_until("live", live, "cancelled")).json["status"] == "cancelled"
