"""A real backend end to end: real HTTP on 127.0.0.1 through ``create_rollout_server()``.

The wire results of every row of wire-protocol section 5.7, honest ``queued``/``running``/
``grading`` statuses, 429 backpressure, cancellation dispositions, ``/health`` and the
trajectory file being in place when a terminal result is seen.

The backend is conftest's ``make_backend``: LocalBackend, or with ``--backend=ray`` a
RayBackend running the same workflows in a Ray worker (shipped by value; the gates they
wait on are conftest's ``gates``, remote then).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    Sample,
    WorkflowContext,
    get_rollout_context,
)

EVENT_SEC = 10.0
"""Upper bound on waiting for an event a test expects (never reached when all is well)."""

TERMINAL = ("success", "failure", "cancelled")
ANSWER = {"role": "assistant", "content": "42"}

SHARED: dict[str, Any] = {}
"""``gates``: the test's conftest ``Gates`` (events the blocking workflows and graders wait
on), captured with the workflows when they travel to a Ray worker."""


def gates() -> Any:
    return SHARED["gates"]


@pytest.fixture(autouse=True)
def _gates(gates: Any) -> None:
    SHARED["gates"] = gates


# -- workflows -------------------------------------------------------------------------


class AnswerWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER], metrics={"turns": 1.0})


class RaisingWorkflow(AgentWorkflow):
    errors: ClassVar[dict[str, Exception]] = {}

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        raise self.errors[ctx.rollout_id]


class BlockingWorkflow(AgentWorkflow):
    """Signals ``started:<id>``, waits for the gate ``<id>``, then answers."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        gates().set(f"started:{ctx.rollout_id}")
        await gates().wait(ctx.rollout_id)
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class SwallowingWorkflow(AgentWorkflow):
    """Swallows its deadline's cancellation and answers anyway."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class DirtyMetricsWorkflow(AgentWorkflow):
    """Hands over, through the sample source, metrics JSON cannot hold."""

    async def run(self, ctx: WorkflowContext) -> None:
        sample = Sample(
            messages=[*ctx.prompt, ANSWER],
            metrics={"bad": math.nan, "obj": object(), "turns": 2},
        )
        get_rollout_context().register_sample_source(lambda: sample)


class DirtyMessagesWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[{"role": "assistant", "content": object()}])


class AmbientWorkflow(AgentWorkflow):
    """Stores what it sees under its rollout id in the gates."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        ambient = get_rollout_context()
        seen = {
            "rollout_id": ambient.rollout_id,
            "url": ambient.chat_completions_url,
            "key": ambient.api_key,
            "process_id": ambient.process_id,
            "artifacts_dir": ctx.artifacts_dir,
            "temperature": None if ctx.config is None else ctx.config.temperature,
        }
        await gates().put(ctx.rollout_id, seen)
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


# -- graders ---------------------------------------------------------------------------


class HalfGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.5)


class RemovingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.7)
        ctx.set_remove_sample()


class SilentGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        return None


class BlockingGrader(Grader):
    """Sets reward 0.25, signals ``grading:<id>`` and waits for the gate ``grader:<id>``."""

    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.25)
        gates().set(f"grading:{ctx.rollout_id}")
        await gates().wait(f"grader:{ctx.rollout_id}")


# -- helpers ---------------------------------------------------------------------------

MakeHarness = Callable[..., Awaitable[Any]]
"""conftest's ``make_harness``: ``await make_harness(backend, **server_kwargs)``."""
Harness = Any
"""conftest's ``Harness`` (test files cannot import conftest)."""


@pytest.fixture
async def make_local(make_harness: MakeHarness, make_backend: Any) -> AsyncIterator[MakeHarness]:
    """Factory: ``await make_local(workflow, **backend_kwargs)`` serves conftest's
    ``make_backend`` through ``make_harness`` (0.3 s long-poll wait, 5 s lease). At
    teardown every gate opens, so no blocked workflow delays the shutdown."""

    async def make(workflow: Any, **kwargs: Any) -> Harness:
        return await make_harness(make_backend(workflow, **kwargs))

    yield make
    for key in await gates().keys():
        gates().set(key)


async def serve(
    make_local: MakeHarness,
    tmp_path: Path,
    workflow: Any,
    *,
    grader: Any = None,
    max_concurrent: int | None = 4,
    max_queued: int | None = None,
) -> Harness:
    """A harness serving the backend under test, its files under ``tmp_path``."""
    return await make_local(
        workflow,
        workflow_config=AgentWorkflowConfig(
            name="test", concurrency={"max_concurrent": max_concurrent}
        ),
        grader=grader,
        max_queued=max_queued,
        artifact_root=tmp_path,
    )


async def run_to_end(harness: Harness, rollout_id: str = "r1", **fields: Any) -> dict[str, Any]:
    """Admit ``rollout_id`` and long-poll until its result is terminal; return the body."""
    token = await harness.admit(rollout_id, **fields)
    reply = await harness.poll_until(rollout_id, token, *TERMINAL)
    body: dict[str, Any] = reply.json
    return body


async def health_until(harness: Harness, predicate: Callable[[dict[str, Any]], bool]) -> None:
    """Read ``/health`` until ``predicate(concurrency)`` holds (bounded)."""
    async with asyncio.timeout(EVENT_SEC):
        while True:
            reply = await harness.health()
            if predicate(reply.json["concurrency"]):
                return


async def wait_gate(key: str) -> None:
    async with asyncio.timeout(EVENT_SEC):
        await gates().wait(key)


def error_of(body: dict[str, Any]) -> tuple[str, str | None, str | None]:
    return body["status"], body["err_message"], body["err_category"]


class TestWireOutcomes:
    """Each row of wire-protocol section 5.7, as a caller sees it over HTTP."""

    async def test_normal(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A graded rollout succeeds with reward 0.5 and no trajectory_messages on the wire."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=HalfGrader)
        body = await run_to_end(harness)
        assert error_of(body) == ("success", None, None)
        assert body["sample"] == {
            "messages": [{"role": "user", "content": "hello"}, ANSWER],
            "label": "L",
            "reward": 0.5,
            "remove_sample": False,
            "metrics": {"turns": 1.0},
            "extra_fields": {},
        }

    async def test_remove_sample(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A removed sample succeeds with a null wire reward; the trajectory keeps 0.7."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=RemovingGrader)
        body = await run_to_end(harness)
        assert error_of(body) == ("success", None, None)
        assert (body["sample"]["remove_sample"], body["sample"]["reward"]) == (True, None)
        trajectory = json.loads((tmp_path / "r1" / "trajectory.json").read_text())
        assert trajectory["extra"]["osmosis"]["reward"] == 0.7
        assert trajectory["extra"]["rollout_server"]["remove_sample"] is True

    async def test_grader_sets_no_reward(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A grader that sets no reward fails as validation_error, the sample attached."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=SilentGrader)
        body = await run_to_end(harness)
        assert error_of(body) == (
            "failure",
            "Sample has no reward after grading",
            "validation_error",
        )
        assert body["sample"]["reward"] is None
        assert body["sample"]["messages"][-1] == ANSWER

    @pytest.mark.parametrize(
        ("exc", "category"),
        [
            (ValueError("bad value"), "validation_error"),
            (RuntimeError("boom"), "agent_error"),
            (TimeoutError("user http timeout"), "timeout"),
        ],
    )
    async def test_workflow_raises(
        self, make_local: MakeHarness, tmp_path: Path, exc: Exception, category: str
    ) -> None:
        """A raising workflow fails with its own message, the category of 5.6 and no sample."""
        RaisingWorkflow.errors["r1"] = exc
        harness = await serve(make_local, tmp_path, RaisingWorkflow, grader=HalfGrader)
        body = await run_to_end(harness, agent_timeout_sec=30.0)
        assert error_of(body) == ("failure", str(exc), category)
        assert body["sample"] is None

    async def test_agent_deadline(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A workflow still running at its deadline fails with the spec's timeout message."""
        harness = await serve(make_local, tmp_path, BlockingWorkflow, grader=HalfGrader)
        body = await run_to_end(harness, agent_timeout_sec=0.05)
        assert error_of(body) == ("failure", "workflow exceeded its 0.05s deadline", "timeout")
        assert body["sample"] is None

    async def test_swallowed_deadline(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A workflow that swallows its deadline and answers is a timeout, not a success."""
        harness = await serve(make_local, tmp_path, SwallowingWorkflow, grader=HalfGrader)
        body = await run_to_end(harness, agent_timeout_sec=0.05)
        assert error_of(body) == ("failure", "workflow exceeded its 0.05s deadline", "timeout")
        assert body["sample"] is None

    async def test_negative_deadline(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A negative agent_timeout_sec is accepted and fails at once as a timeout."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=HalfGrader)
        body = await run_to_end(harness, agent_timeout_sec=-1)
        assert error_of(body) == ("failure", "workflow exceeded its -1.0s deadline", "timeout")

    async def test_grader_deadline(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A grader past its deadline fails as timeout; the sample is sent, reward nulled."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=BlockingGrader)
        body = await run_to_end(harness, grader_timeout_sec=0.05)
        assert error_of(body) == ("failure", "grader exceeded its 0.05s deadline", "timeout")
        assert body["sample"]["reward"] is None
        assert body["sample"]["messages"][-1] == ANSWER

    async def test_no_label_and_no_metadata(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """With nothing to grade against, grade=true gives failure with every field null."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=HalfGrader)
        body = await run_to_end(harness, label=None, metadata=None)
        assert error_of(body) == ("failure", None, None)
        assert body["sample"] is None

    async def test_empty_metadata_enables_grading(
        self, make_local: MakeHarness, tmp_path: Path
    ) -> None:
        """metadata {} counts as present: the rollout is graded although label is null."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=HalfGrader)
        body = await run_to_end(harness, label=None, metadata={})
        assert error_of(body) == ("success", None, None)
        assert body["sample"]["reward"] == 0.5

    async def test_no_grader_grade_true(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """No grader and grade=true give failure with every field null; the trajectory
        still has the workflow's messages."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow)
        body = await run_to_end(harness)
        assert error_of(body) == ("failure", None, None)
        assert body["sample"] is None
        trajectory = json.loads((tmp_path / "r1" / "trajectory.json").read_text())
        assert trajectory["steps"][-1]["message"] == ANSWER["content"]

    async def test_no_grader_grade_false(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """No grader and grade=false give success with the workflow sample, reward null."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow)
        body = await run_to_end(harness, grade=False)
        assert error_of(body) == ("success", None, None)
        assert body["sample"]["reward"] is None
        assert body["sample"]["messages"][-1] == ANSWER

    async def test_non_json_metrics_are_dropped(
        self, make_local: MakeHarness, tmp_path: Path
    ) -> None:
        """NaN and object metrics are dropped from the wire; the rest and the reward stay."""
        harness = await serve(make_local, tmp_path, DirtyMetricsWorkflow, grader=HalfGrader)
        body = await run_to_end(harness)
        assert error_of(body) == ("success", None, None)
        assert body["sample"]["metrics"] == {"turns": 2}
        assert body["sample"]["reward"] == 0.5

    async def test_non_json_messages(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """Messages JSON cannot hold give a minimal sample that keeps the reward."""
        harness = await serve(make_local, tmp_path, DirtyMessagesWorkflow, grader=HalfGrader)
        body = await run_to_end(harness)
        assert error_of(body) == ("success", None, None)
        assert body["sample"]["messages"] == []
        assert body["sample"]["reward"] == 0.5


class TestStatuses:
    async def test_queued_running_grading(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """With one slot, the second rollout reports queued while the first runs and grades,
        then running once it holds the slot."""
        harness = await serve(
            make_local, tmp_path, BlockingWorkflow, grader=BlockingGrader, max_concurrent=1
        )
        first = await harness.admit("a")
        await harness.poll_until("a", first, "running")
        second = await harness.admit("b")
        await health_until(harness, lambda c: c["queued"] == 1)
        reply = await harness.poll("b", second)
        assert reply.json["status"] == "queued"
        gates().set("a")
        await harness.poll_until("a", first, "grading")
        assert (await harness.poll("b", second)).json["status"] == "queued"
        gates().set("grader:a")
        await harness.poll_until("b", second, "running")
        done = await harness.poll_until("a", first, *TERMINAL)
        assert error_of(done.json) == ("success", None, None)
        gates().set("b")
        gates().set("grader:b")
        assert (await harness.poll_until("b", second, *TERMINAL)).json["status"] == "success"

    async def test_trajectory_exists_when_the_result_is_seen(
        self, make_local: MakeHarness, tmp_path: Path
    ) -> None:
        """The trajectory is written before publication: a terminal poll can read it."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=HalfGrader)
        await run_to_end(harness, "t1", extra_fields={"run": 7}, metadata={"k": "v"})
        trajectory = json.loads((tmp_path / "t1" / "trajectory.json").read_text())
        assert trajectory["session_id"] == "t1"
        assert trajectory["extra"]["rollout_server"]["status"] == "success"
        assert trajectory["extra"]["osmosis"] == {
            "rollout_id": "t1",
            "label": "L",
            "reward": 0.5,
            "sample_metrics": {"turns": 1.0},
            "request_metadata": {"k": "v"},
            "request_extra_fields": {"run": 7},
        }
        assert trajectory["steps"][-1]["message"] == ANSWER["content"]
        # AnswerWorkflow never reads ctx.artifacts_dir, so none was made.
        assert sorted(p.name for p in (tmp_path / "t1").iterdir()) == ["trajectory.json"]


class TestAmbientContext:
    async def test_request_values_and_key_fallback(
        self, make_local: MakeHarness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Workflow code finds the chat URL, the rollout id, the process id and, without an
        llm_api_key, the OSMOSIS_API_KEY fallback through get_rollout_context()."""
        monkeypatch.setenv("OSMOSIS_API_KEY", "sk-from-env")
        # A Ray worker reads its own environment: give it the variable there too.
        env = {"env_vars": {"OSMOSIS_API_KEY": "sk-from-env"}}
        harness = await make_local(
            AmbientWorkflow,
            workflow_config=AgentWorkflowConfig(name="ambient", temperature=0.3),
            artifact_root=tmp_path,
            ray={"worker_options": {"runtime_env": env}},
        )
        await run_to_end(harness, "x1", grade=False)
        await run_to_end(harness, "x2", grade=False, llm_api_key="sk-request")
        process_id = (await harness.health()).json["process_id"]
        assert await gates().get("x1") == {
            "rollout_id": "x1",
            "url": "http://127.0.0.1:9/v1",
            "key": "sk-from-env",
            "process_id": process_id,
            "artifacts_dir": tmp_path / "x1" / "artifacts",
            "temperature": 0.3,
        }
        assert (await gates().get("x2"))["key"] == "sk-request"


class TestBackpressure:
    async def test_429_with_retry_after_then_admission(
        self, make_local: MakeHarness, tmp_path: Path, body: Callable[..., dict[str, Any]]
    ) -> None:
        """With one slot and max_queued=1, a third rollout gets 429 with a load-based
        Retry-After, and is admitted once the queue has room again."""
        harness = await serve(
            make_local, tmp_path, BlockingWorkflow, max_concurrent=1, max_queued=1
        )
        first = await harness.admit("a", grade=False)
        await wait_gate("started:a")
        second = await harness.admit("b", grade=False)
        await health_until(harness, lambda c: c["queued"] == 1)
        refused = await harness.post_rollout(body("c", grade=False))
        assert refused.status == 429, refused
        # Two rollouts would be ahead of it, each assumed to take 5 s, on one slot.
        assert refused.headers["Retry-After"] == "10"
        health = (await harness.health()).json["concurrency"]
        assert health == {"max_concurrent": 1, "queued": 1, "running": 1, "max_queued": 1}
        gates().set("a")
        await harness.poll_until("a", first, *TERMINAL)
        await wait_gate("started:b")
        third = await harness.admit("c", grade=False)
        gates().set("b")
        gates().set("c")
        for rollout_id, token in (("b", second), ("c", third)):
            reply = await harness.poll_until(rollout_id, token, *TERMINAL)
            assert reply.json["status"] == "success"


class TestCancellation:
    async def test_cancel_queued(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A queued rollout cancels as cancelled_queued and leaves the queue at once."""
        harness = await serve(make_local, tmp_path, BlockingWorkflow, max_concurrent=1)
        await harness.admit("a", grade=False)
        await wait_gate("started:a")
        token = await harness.admit("b", grade=False)
        await health_until(harness, lambda c: c["queued"] == 1)
        reply = await harness.cancel({"ids": ["b"], "prefix": None, "all": False})
        assert reply.json == {"dispositions": {"b": "cancelled_queued"}}
        done = await harness.poll_until("b", token, *TERMINAL)
        assert error_of(done.json) == ("cancelled", "cancelled", None)
        health = (await harness.health()).json["concurrency"]
        assert (health["queued"], health["running"]) == (0, 1)
        assert "started:b" not in await gates().keys()
        gates().set("a")

    async def test_cancel_running_frees_the_slot(
        self, make_local: MakeHarness, tmp_path: Path
    ) -> None:
        """A running rollout cancels as cancelled_running and its slot goes to the next one."""
        harness = await serve(make_local, tmp_path, BlockingWorkflow, max_concurrent=1)
        first = await harness.admit("a", grade=False)
        await wait_gate("started:a")
        second = await harness.admit("b", grade=False)
        await health_until(harness, lambda c: c["queued"] == 1)
        reply = await harness.cancel({"ids": ["a"], "prefix": None, "all": False})
        assert reply.json == {"dispositions": {"a": "cancelled_running"}}
        done = await harness.poll_until("a", first, *TERMINAL)
        assert error_of(done.json) == ("cancelled", "cancelled", None)
        await harness.poll_until("b", second, "running")
        await wait_gate("started:b")
        gates().set("b")
        assert (await harness.poll_until("b", second, *TERMINAL)).json["status"] == "success"

    async def test_cancel_grading(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """A grading rollout cancels as cancelled_running, result cancelled/"cancelled",
        and its slot is free at once."""
        harness = await serve(make_local, tmp_path, AnswerWorkflow, grader=BlockingGrader)
        token = await harness.admit("g")
        await harness.poll_until("g", token, "grading")
        await wait_gate("grading:g")
        reply = await harness.cancel({"ids": ["g"], "prefix": None, "all": False})
        assert reply.json == {"dispositions": {"g": "cancelled_running"}}
        done = await harness.poll_until("g", token, *TERMINAL)
        assert error_of(done.json) == ("cancelled", "cancelled", None)
        assert done.json["sample"] is None
        health = (await harness.health()).json["concurrency"]
        assert (health["queued"], health["running"]) == (0, 0)


class TestHealth:
    async def test_payload(self, make_local: MakeHarness, tmp_path: Path) -> None:
        """/health carries the concurrency block of LocalBackend (which RayBackend
        shares) with max_queued."""
        harness = await make_local(AnswerWorkflow, max_queued=8, artifact_root=tmp_path)
        reply = await harness.health()
        assert reply.json["status"] == "ok"
        assert reply.json["concurrency"] == {
            "max_concurrent": 4,
            "queued": 0,
            "running": 0,
            "max_queued": 8,
        }
