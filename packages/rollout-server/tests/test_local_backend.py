"""LocalBackend.execute(): grading gate, deadlines, statuses, cancellation, backpressure,
artifacts and trajectory persistence, called directly (no HTTP)."""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import atif
import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    ExecutionOutcome,
    ExecutionRequest,
    Grader,
    GraderContext,
    LocalBackend,
    RolloutContext,
    Sample,
    WorkflowContext,
    current_rollout_context,
    get_rollout_context,
)
from rollout_server.execution import _trajectory as trajectory_module
from rollout_server.execution._context import bind_rollout_context
from rollout_types import RolloutErrorCategory, RolloutStatus

WAIT_SEC = 5.0
PROMPT = [{"role": "user", "content": "What is 6*7?"}]
ANSWER = {"role": "assistant", "content": "42"}

# Per-rollout gates the blocking workflows and graders wait on (keyed by rollout id).
GATES: dict[str, asyncio.Event] = {}
STARTED: dict[str, asyncio.Event] = {}
RAN_FOR: dict[str, float] = {}


def _event(table: dict[str, asyncio.Event], key: str) -> asyncio.Event:
    return table.setdefault(key, asyncio.Event())


class StatusLog:
    """Records the statuses a backend reports and lets a test wait for one."""

    def __init__(self) -> None:
        self.seen: list[RolloutStatus] = []
        self._events: collections.defaultdict[RolloutStatus, asyncio.Event] = (
            collections.defaultdict(asyncio.Event)
        )

    def __call__(self, status: RolloutStatus) -> None:
        self.seen.append(status)
        self._events[status].set()

    async def wait_for(self, status: RolloutStatus) -> None:
        async with asyncio.timeout(WAIT_SEC):
            await self._events[status].wait()


def make_request(
    rollout_id: str = "r1", statuses: StatusLog | None = None, **kwargs: Any
) -> ExecutionRequest:
    kwargs.setdefault("label", "42")
    return ExecutionRequest(
        id=rollout_id,
        prompt=[dict(message) for message in PROMPT],
        chat_completions_url="http://127.0.0.1:9/v1",
        llm_api_key="sk-test",
        on_status=statuses if statuses is not None else StatusLog(),
        **kwargs,
    )


def read_trajectory(root: Path, rollout_id: str) -> dict[str, Any]:
    """The rollout's ``trajectory.json``, checked against the ATIF models."""
    data: dict[str, Any] = json.loads((root / rollout_id / "trajectory.json").read_text())
    atif.Trajectory.model_validate(data, strict=True)
    return data


def record_of(document: dict[str, Any]) -> dict[str, Any]:
    """What the trajectory document records about the rollout beyond its conversation."""
    record: dict[str, Any] = document["extra"]["rollout_server"]
    return record


def messages_of(document: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(source, message)`` of each step of a trajectory document."""
    return [(step["source"], step["message"]) for step in document["steps"]]


CONVERSATION = [("user", PROMPT[0]["content"]), ("agent", ANSWER["content"])]
"""``messages_of`` a trajectory of ``[*PROMPT, ANSWER]``."""


def listing(path: Path) -> list[str]:
    return sorted(child.name for child in path.iterdir())


async def until(predicate: Any) -> None:
    """Yield to the loop until ``predicate()`` holds (bounded).

    The backend's queue counts have no event to wait on; this only yields, it never sleeps.
    """
    async with asyncio.timeout(WAIT_SEC):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0)


# -- workflows -------------------------------------------------------------------------


class AnswerWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(
            messages=[*ctx.prompt, ANSWER], metrics={"turns": 1.0}, info={"note": "done"}
        )


class ListWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        return [*ctx.prompt, ANSWER]


class NoneWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> None:
        return None


class NoMessagesWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=None)


class SourceWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> None:
        sample = Sample(messages=[*ctx.prompt, ANSWER], metrics={"from": "source"})
        get_rollout_context().register_sample_source(lambda: sample)


class BadReturnWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> Any:
        return {"messages": []}


class BadListWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> Any:
        return [ANSWER, "not a message"]


class RaisingWorkflow(AgentWorkflow):
    errors: ClassVar[dict[str, BaseException]] = {}

    async def run(self, ctx: WorkflowContext) -> Any:
        raise self.errors[ctx.rollout_id]


class BlockingWorkflow(AgentWorkflow):
    """Waits for its rollout's gate, then answers."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        _event(STARTED, ctx.rollout_id).set()
        start = time.monotonic()
        try:
            await _event(GATES, ctx.rollout_id).wait()
        finally:
            RAN_FOR[ctx.rollout_id] = time.monotonic() - start
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class SwallowingWorkflow(AgentWorkflow):
    """Ignores the first cancellation, then waits for its gate and answers."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        _event(STARTED, ctx.rollout_id).set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await _event(GATES, ctx.rollout_id).wait()
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class LoopBlockingWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        time.sleep(0.3)  # noqa: ASYNC251 - blocks the loop on purpose
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class ContextWorkflow(AgentWorkflow):
    seen: ClassVar[dict[str, Any]] = {}

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        ambient = get_rollout_context()
        self.seen[ctx.rollout_id] = {
            "url": ambient.chat_completions_url,
            "key": ambient.api_key,
            "rollout_id": ambient.rollout_id,
            "process_id": ambient.process_id,
            "config": ctx.config,
            "metadata": ctx.metadata,
            "artifacts_dir": ctx.artifacts_dir,
            "own_config": self.config,
        }
        assert ctx.artifacts_dir is not None
        (ctx.artifacts_dir / "note.txt").write_text("kept")
        ctx.prompt.append({"role": "user", "content": "mutated"})
        if ctx.metadata is not None:
            ctx.metadata["mutated"] = True
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


class MutatingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        ctx.sample.messages.append({"role": "grader", "content": "note"})
        ctx.set_reward(1.0)


class BlockingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.25)
        _event(STARTED, f"grader:{ctx.rollout_id}").set()
        await _event(GATES, f"grader:{ctx.rollout_id}").wait()


class SwallowingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.9)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass


class RaisingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        raise RuntimeError("grader broke")


class ContextGrader(Grader):
    seen: ClassVar[dict[str, Any]] = {}

    async def grade(self, ctx: GraderContext) -> None:
        self.seen[ctx.rollout_id] = {
            "label": ctx.label,
            "metadata": ctx.metadata,
            "artifacts_dir": ctx.artifacts_dir,
            "config": self.config,
            "ambient": current_rollout_context(),
        }
        ctx.set_reward(1.0)


@pytest.fixture(autouse=True)
def _reset_tables() -> None:
    GATES.clear()
    STARTED.clear()
    RAN_FOR.clear()


def backend_for(tmp_path: Path, workflow: Any, **kwargs: Any) -> LocalBackend:
    return LocalBackend(workflow, artifact_root=tmp_path, **kwargs)


def assert_failure(result: Any, message: str | None, category: RolloutErrorCategory | None) -> None:
    assert result.status == RolloutStatus.FAILURE
    assert result.err_message == message
    assert result.err_category == category


class TestOutcomes:
    """The rows of wire-protocol section 5.7, at the backend level."""

    async def test_normal(self, tmp_path: Path) -> None:
        """A graded rollout succeeds with the grader's reward, reporting running then grading."""
        statuses = StatusLog()
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(statuses=statuses))
        assert outcome.workflow.status == RolloutStatus.SUCCESS
        assert outcome.grader is not None
        assert outcome.grader.status == RolloutStatus.SUCCESS
        sample = outcome.reported().sample
        assert sample is not None
        assert (sample.reward, sample.label, sample.remove_sample) == (0.5, "42", False)
        assert sample.messages == [*PROMPT, ANSWER]
        assert sample.metrics == {"turns": 1.0}
        assert statuses.seen == [RolloutStatus.RUNNING, RolloutStatus.GRADING]

    async def test_remove_sample(self, tmp_path: Path) -> None:
        """A grader that removes the sample succeeds with the flag set (the wire nulls the
        reward)."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=RemovingGrader)
        result = (await backend.execute(make_request())).reported()
        assert result.status == RolloutStatus.SUCCESS
        assert result.sample is not None
        assert (result.sample.remove_sample, result.sample.reward) == (True, 0.7)

    async def test_grader_sets_no_reward(self, tmp_path: Path) -> None:
        """A grader that sets no reward fails validation and keeps the unrewarded sample."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=SilentGrader)
        result = (await backend.execute(make_request())).reported()
        assert_failure(
            result, "Sample has no reward after grading", RolloutErrorCategory.VALIDATION_ERROR
        )
        assert result.sample is not None
        assert result.sample.reward is None
        assert result.sample.messages == [*PROMPT, ANSWER]

    @pytest.mark.parametrize(
        ("exc", "message", "category"),
        [
            (ValueError("bad value"), "bad value", RolloutErrorCategory.VALIDATION_ERROR),
            (RuntimeError("boom"), "boom", RolloutErrorCategory.AGENT_ERROR),
            (TimeoutError("user http timeout"), "user http timeout", RolloutErrorCategory.TIMEOUT),
            (TimeoutError(), "", RolloutErrorCategory.TIMEOUT),
        ],
    )
    async def test_workflow_raises(
        self,
        tmp_path: Path,
        exc: BaseException,
        message: str,
        category: RolloutErrorCategory,
    ) -> None:
        """A raising workflow fails with str(exc) and its category, no sample, no grading."""
        RaisingWorkflow.errors["r1"] = exc
        statuses = StatusLog()
        backend = backend_for(tmp_path, RaisingWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(statuses=statuses))
        assert outcome.grader is None
        assert_failure(outcome.workflow, message, category)
        assert outcome.workflow.sample is None
        assert RolloutStatus.GRADING not in statuses.seen

    async def test_user_timeout_keeps_its_message_under_a_deadline(self, tmp_path: Path) -> None:
        """A workflow's own TimeoutError before its deadline keeps the user's message."""
        RaisingWorkflow.errors["r1"] = TimeoutError("user http timeout")
        backend = backend_for(tmp_path, RaisingWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(agent_timeout_sec=30.0))
        assert_failure(outcome.workflow, "user http timeout", RolloutErrorCategory.TIMEOUT)

    async def test_no_label_no_metadata(self, tmp_path: Path) -> None:
        """With a grader but neither label nor metadata, the grader result is a bare failure."""
        statuses = StatusLog()
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(statuses=statuses, label=None))
        assert outcome.workflow.status == RolloutStatus.SUCCESS
        assert outcome.grader is not None
        assert outcome.grader.sample is None
        assert_failure(outcome.reported(), None, None)
        assert outcome.reported().sample is None
        assert statuses.seen == [RolloutStatus.RUNNING]

    async def test_empty_metadata_counts_as_present(self, tmp_path: Path) -> None:
        """metadata {} without a label still enables grading."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=ContextGrader)
        result = (await backend.execute(make_request(label=None, metadata={}))).reported()
        assert result.status == RolloutStatus.SUCCESS
        assert ContextGrader.seen["r1"]["label"] is None
        assert ContextGrader.seen["r1"]["metadata"] == {}

    async def test_no_grader_grade_true(self, tmp_path: Path) -> None:
        """Without a grader, a graded request fails with every field null."""
        backend = backend_for(tmp_path, AnswerWorkflow)
        outcome = await backend.execute(make_request())
        assert outcome.workflow.status == RolloutStatus.SUCCESS
        assert_failure(outcome.reported(), None, None)
        assert outcome.reported().sample is None

    async def test_no_grader_grade_false(self, tmp_path: Path) -> None:
        """Without a grader, an ungraded request succeeds with the sample and no reward."""
        backend = backend_for(tmp_path, AnswerWorkflow)
        outcome = await backend.execute(make_request(grade=False))
        assert outcome.grader is None
        result = outcome.reported()
        assert result.status == RolloutStatus.SUCCESS
        assert result.sample is not None
        assert result.sample.reward is None

    async def test_grade_false_skips_the_grader(self, tmp_path: Path) -> None:
        """grade=false never runs a configured grader."""
        statuses = StatusLog()
        backend = backend_for(tmp_path, AnswerWorkflow, grader=RaisingGrader)
        outcome = await backend.execute(make_request(statuses=statuses, grade=False))
        assert outcome.grader is None
        assert statuses.seen == [RolloutStatus.RUNNING]

    async def test_grader_raises(self, tmp_path: Path) -> None:
        """A raising grader fails the rollout with the workflow's sample attached."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=RaisingGrader)
        result = (await backend.execute(make_request())).reported()
        assert_failure(result, "grader broke", RolloutErrorCategory.AGENT_ERROR)
        assert result.sample is not None
        assert result.sample.messages == [*PROMPT, ANSWER]


class TestReturnValues:
    async def test_bare_message_list(self, tmp_path: Path) -> None:
        """A bare message list becomes the sample's messages."""
        backend = backend_for(tmp_path, ListWorkflow, grader=HalfGrader)
        result = (await backend.execute(make_request())).reported()
        assert result.sample is not None
        assert result.sample.messages == [*PROMPT, ANSWER]
        assert result.sample.reward == 0.5

    async def test_sample_source(self, tmp_path: Path) -> None:
        """run() returning None takes the registered source's sample, labelled from the
        request."""
        backend = backend_for(tmp_path, SourceWorkflow, grader=HalfGrader)
        result = (await backend.execute(make_request())).reported()
        assert result.status == RolloutStatus.SUCCESS
        assert result.sample is not None
        assert result.sample.label == "42"
        assert result.sample.metrics == {"from": "source"}
        assert result.sample.trajectory_messages == [*PROMPT, ANSWER]

    async def test_async_sample_source(self, tmp_path: Path) -> None:
        """An async sample source is awaited."""

        class AsyncSourceWorkflow(AgentWorkflow):
            async def run(self, ctx: WorkflowContext) -> None:
                async def source() -> Sample:
                    await asyncio.sleep(0)
                    return Sample(messages=[*ctx.prompt, ANSWER])

                get_rollout_context().register_sample_source(source)

        backend = backend_for(tmp_path, AsyncSourceWorkflow, grader=HalfGrader)
        result = (await backend.execute(make_request())).reported()
        assert result.status == RolloutStatus.SUCCESS
        assert result.sample is not None
        assert (result.sample.messages, result.sample.reward) == ([*PROMPT, ANSWER], 0.5)

    async def test_bad_sample_source(self, tmp_path: Path) -> None:
        """A source returning something other than a Sample is a validation_error, and a
        non-callable source is refused when registered."""

        class BadSourceWorkflow(AgentWorkflow):
            async def run(self, ctx: WorkflowContext) -> None:
                with pytest.raises(TypeError, match="needs a callable"):
                    get_rollout_context().register_sample_source("nope")  # type: ignore[arg-type]
                get_rollout_context().register_sample_source(lambda: {"messages": []})  # type: ignore[arg-type,return-value]

        backend = backend_for(tmp_path, BadSourceWorkflow)
        outcome = await backend.execute(make_request(grade=False))
        assert_failure(
            outcome.workflow,
            "the registered sample source must return a rollout_server.Sample or None; got dict",
            RolloutErrorCategory.VALIDATION_ERROR,
        )

    async def test_none_without_source_then_grading(self, tmp_path: Path) -> None:
        """No sample and a grader that rewards fails with the no-sample message."""
        backend = backend_for(tmp_path, NoneWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request())
        assert outcome.workflow.status == RolloutStatus.SUCCESS
        assert outcome.workflow.sample is None
        assert_failure(
            outcome.reported(),
            "GraderContext has no sample to reward",
            RolloutErrorCategory.VALIDATION_ERROR,
        )

    async def test_no_sample_and_a_silent_grader(self, tmp_path: Path) -> None:
        """A grader that leaves a missing sample alone fails with 'No sample to grade.'."""
        backend = backend_for(tmp_path, NoMessagesWorkflow, grader=SilentGrader)
        result = (await backend.execute(make_request())).reported()
        assert result.status == RolloutStatus.FAILURE
        assert result.err_message is not None
        assert result.err_message.startswith("No sample to grade.")
        assert result.err_category == RolloutErrorCategory.VALIDATION_ERROR

    async def test_no_sample_ungraded(self, tmp_path: Path) -> None:
        """An ungraded rollout without a sample succeeds with no sample."""
        backend = backend_for(tmp_path, NoneWorkflow)
        result = (await backend.execute(make_request(grade=False))).reported()
        assert result.status == RolloutStatus.SUCCESS
        assert result.sample is None

    async def test_bad_return_type(self, tmp_path: Path) -> None:
        """Any other return value is a validation_error with the exact osmosis message."""
        backend = backend_for(tmp_path, BadReturnWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request())
        assert_failure(
            outcome.workflow,
            "run() must return AgentWorkflowOutput, a message list, or None; got dict",
            RolloutErrorCategory.VALIDATION_ERROR,
        )
        assert outcome.grader is None

    async def test_bad_message_in_list(self, tmp_path: Path) -> None:
        """A message list with a non-dict item is a validation_error naming the item."""
        backend = backend_for(tmp_path, BadListWorkflow)
        outcome = await backend.execute(make_request(grade=False))
        assert outcome.workflow.status == RolloutStatus.FAILURE
        assert outcome.workflow.err_category == RolloutErrorCategory.VALIDATION_ERROR
        assert "item 1 is a str" in (outcome.workflow.err_message or "")


class TestContexts:
    async def test_workflow_and_grader_contexts(self, tmp_path: Path) -> None:
        """The workflow gets copies, the ambient context and its artifacts dir; the grader
        gets label, metadata, the same dir and the config as is."""
        config = AgentWorkflowConfig(name="ctx", extra={"model": "m"})
        grader_config = {"name": "g"}
        request = make_request(metadata={"task": 1})
        backend = backend_for(
            tmp_path,
            ContextWorkflow,
            workflow_config=config,
            grader=ContextGrader,
            grader_config=grader_config,
        )
        outcome = await backend.execute(request)
        assert outcome.reported().status == RolloutStatus.SUCCESS
        seen = ContextWorkflow.seen["r1"]
        assert seen["url"] == "http://127.0.0.1:9/v1"
        assert seen["key"] == "sk-test"
        assert seen["rollout_id"] == "r1"
        assert seen["config"] == config
        assert seen["config"] is not config
        assert seen["own_config"] is seen["config"]
        artifacts = tmp_path / "r1" / "artifacts"
        assert seen["artifacts_dir"] == artifacts
        assert (artifacts / "note.txt").read_text() == "kept"
        assert request.prompt == PROMPT
        assert request.metadata == {"task": 1}
        graded = ContextGrader.seen["r1"]
        assert graded["label"] == "42"
        assert graded["metadata"] == {"task": 1}
        assert graded["artifacts_dir"] == artifacts
        assert graded["config"].name == "g"
        assert graded["ambient"].rollout_id == "r1"
        assert current_rollout_context() is None

    async def test_uses_the_bound_ambient_context(self, tmp_path: Path) -> None:
        """When the server has bound a context for this rollout, the workflow sees it."""
        backend = backend_for(tmp_path, ContextWorkflow)
        bound = RolloutContext(rollout_id="r1", chat_completions_url="http://x/v1", process_id="p")
        with bind_rollout_context(bound):
            await backend.execute(make_request(grade=False))
        assert ContextWorkflow.seen["r1"]["process_id"] == "p"
        assert ContextWorkflow.seen["r1"]["url"] == "http://x/v1"

    async def test_fresh_workflow_instance_per_rollout(self, tmp_path: Path) -> None:
        """Every rollout gets its own workflow instance and config copy."""
        config = AgentWorkflowConfig(name="ctx", extra={"list": [1]})
        backend = backend_for(tmp_path, ContextWorkflow, workflow_config=config)
        await backend.execute(make_request("a", grade=False))
        await backend.execute(make_request("b", grade=False))
        first, second = ContextWorkflow.seen["a"]["config"], ContextWorkflow.seen["b"]["config"]
        assert first is not second
        assert first.extra["list"] is not second.extra["list"]

    async def test_artifacts_dir_failure_is_best_effort(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """When the artifacts directory cannot be made (after 3 tries), the workflow gets
        None and still runs."""
        monkeypatch.setattr(trajectory_module, "ARTIFACTS_DIR_RETRY_DELAYS_SEC", (0.0, 0.0))
        root = tmp_path / "file"
        root.write_text("not a directory")

        seen: list[Any] = []

        class Probe(AgentWorkflow):
            async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
                seen.append(ctx.artifacts_dir)
                return [ANSWER]

        backend = LocalBackend(Probe, artifact_root=root)
        with caplog.at_level(logging.WARNING, logger="rollout_server"):
            outcome = await backend.execute(make_request(grade=False))
        assert outcome.workflow.status == RolloutStatus.SUCCESS
        assert seen == [None]
        assert "after 3 attempts" in caplog.text
        assert "cannot save the trajectory" in caplog.text

    async def test_artifacts_dir_is_made_when_first_read(self, tmp_path: Path) -> None:
        """A workflow that never reads ctx.artifacts_dir leaves no artifacts directory; a
        grader that reads it later gets it made then."""
        seen: list[Any] = []

        class Reader(Grader):
            async def grade(self, ctx: GraderContext) -> None:
                seen.append((tmp_path / "r1" / "artifacts").exists())
                seen.append(ctx.artifacts_dir)
                ctx.set_reward(1.0)

        outcome = await backend_for(tmp_path, AnswerWorkflow, grader=Reader).execute(make_request())
        assert outcome.reported().status == RolloutStatus.SUCCESS
        assert seen == [False, tmp_path / "r1" / "artifacts"]
        assert (tmp_path / "r1" / "artifacts").is_dir()

    async def test_artifacts_dir_that_cannot_be_made_is_none(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """When ``artifacts/`` cannot be made inside the rollout directory (a file is in the
        way), the workflow and the grader both get None, one WARNING says why, and the
        rollout and its trajectory are unaffected."""
        (tmp_path / "r1").mkdir()
        (tmp_path / "r1" / "artifacts").write_text("in the way")
        seen: list[Any] = []

        class Probe(AgentWorkflow):
            async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
                seen.extend([ctx.artifacts_dir, ctx.artifacts_dir])
                return [ANSWER]

        class Reader(Grader):
            async def grade(self, ctx: GraderContext) -> None:
                seen.append(ctx.artifacts_dir)
                ctx.set_reward(1.0)

        backend = backend_for(tmp_path, Probe, grader=Reader)
        with caplog.at_level(logging.WARNING, logger="rollout_server"):
            outcome = await backend.execute(make_request())
        assert outcome.reported().status == RolloutStatus.SUCCESS
        assert seen == [None, None, None]
        warnings = [r for r in caplog.records if "artifacts directory" in r.getMessage()]
        assert len(warnings) == 1
        assert str(tmp_path / "r1" / "artifacts") in warnings[0].getMessage()
        assert record_of(read_trajectory(tmp_path, "r1"))["status"] == "success"


class TestDeadlines:
    async def test_agent_deadline(self, tmp_path: Path) -> None:
        """A workflow still running at its deadline fails as timeout with the spec message."""
        backend = backend_for(tmp_path, BlockingWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(agent_timeout_sec=0.5))
        assert_failure(
            outcome.workflow, "workflow exceeded its 0.5s deadline", RolloutErrorCategory.TIMEOUT
        )
        assert outcome.workflow.sample is None
        assert outcome.grader is None

    async def test_swallowed_cancellation_is_a_timeout(self, tmp_path: Path) -> None:
        """A workflow that swallows the deadline and answers later is a timeout, not a
        success."""
        GATES["r1"] = asyncio.Event()
        GATES["r1"].set()
        backend = backend_for(tmp_path, SwallowingWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(agent_timeout_sec=0.5))
        assert_failure(
            outcome.workflow, "workflow exceeded its 0.5s deadline", RolloutErrorCategory.TIMEOUT
        )
        assert outcome.workflow.sample is None

    async def test_loop_blocking_return_is_a_timeout(self, tmp_path: Path) -> None:
        """A workflow that blocks the loop past its budget and returns is a timeout."""
        backend = backend_for(tmp_path, LoopBlockingWorkflow)
        outcome = await backend.execute(make_request(agent_timeout_sec=0.1, grade=False))
        assert_failure(
            outcome.workflow, "workflow exceeded its 0.1s deadline", RolloutErrorCategory.TIMEOUT
        )

    @pytest.mark.parametrize(("timeout", "text"), [(-1, "-1.0"), (0, "0.0")])
    async def test_expired_budget(self, tmp_path: Path, timeout: float, text: str) -> None:
        """A budget of zero or less expires at once, printing the request value as a float."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(agent_timeout_sec=timeout))
        assert_failure(
            outcome.workflow,
            f"workflow exceeded its {text}s deadline",
            RolloutErrorCategory.TIMEOUT,
        )

    async def test_queue_time_counts_against_the_budget(self, tmp_path: Path) -> None:
        """A rollout that waited for a slot gets only what the queue left of its budget."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config)
        first = asyncio.create_task(backend.execute(make_request("first", grade=False)))
        await _event(STARTED, "first").wait()
        second = asyncio.create_task(
            backend.execute(make_request("second", grade=False, agent_timeout_sec=1.0))
        )
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        await asyncio.sleep(0.3)  # queue time for "second", not a wait for an event
        GATES["first"] = _event(GATES, "first")
        GATES["first"].set()
        await asyncio.wait_for(first, WAIT_SEC)
        outcome = await asyncio.wait_for(second, WAIT_SEC)
        message = outcome.workflow.err_message or ""
        assert re.fullmatch(
            r"workflow exceeded its 1\.0s deadline \((\d+\.\d)s of it spent queued\)", message
        ), message
        queued = float(re.findall(r"\((\d+\.\d)s", message)[0])
        assert queued >= 0.3
        # A deadline never fires early, so without the deduction it would have run >= 1 s.
        assert RAN_FOR["second"] < 1.0

    async def test_queue_time_counts_from_admission(self, tmp_path: Path) -> None:
        """Time between the server's admission stamp and execute() counts as queue time."""
        backend = backend_for(tmp_path, BlockingWorkflow)
        request = make_request(
            "late", grade=False, agent_timeout_sec=0.5, admitted_at=time.monotonic() - 1.2
        )
        outcome = await backend.execute(request)
        message = outcome.workflow.err_message or ""
        found = re.fullmatch(
            r"workflow exceeded its 0\.5s deadline \((\d+\.\d)s of it spent queued\)", message
        )
        assert found, message
        assert float(found.group(1)) >= 1.2
        assert "late" not in STARTED  # the budget was gone before it could run
        assert not (tmp_path / "late").exists()  # no conversation, no diagnostics: no files

    async def test_future_admission_stamp_is_ignored(self, tmp_path: Path) -> None:
        """An admission stamp in the future (a foreign clock) is not trusted: the clock
        starts at execute()."""
        backend = backend_for(tmp_path, AnswerWorkflow)
        request = make_request(
            "skew", grade=False, agent_timeout_sec=30.0, admitted_at=time.monotonic() + 1e6
        )
        outcome = await backend.execute(request)
        assert outcome.workflow.status == RolloutStatus.SUCCESS

    async def test_deadline_passing_in_the_queue(self, tmp_path: Path) -> None:
        """A rollout whose budget ends while queued fails without ever taking a slot."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config)
        first = asyncio.create_task(backend.execute(make_request("first", grade=False)))
        await _event(STARTED, "first").wait()
        statuses = StatusLog()
        outcome = await backend.execute(
            make_request("late", statuses=statuses, grade=False, agent_timeout_sec=0.3)
        )
        assert outcome.workflow.err_category == RolloutErrorCategory.TIMEOUT
        message = outcome.workflow.err_message or ""
        found = re.fullmatch(
            r"workflow exceeded its 0\.3s deadline \((\d+\.\d)s of it spent queued\)", message
        )
        assert found, message
        assert float(found.group(1)) >= 0.3
        assert statuses.seen == [RolloutStatus.QUEUED]  # never running
        assert "late" not in STARTED
        assert backend.health()["concurrency"] | {"max_queued": None} == {
            "max_concurrent": 1,
            "queued": 0,
            "running": 1,
            "max_queued": None,
        }
        _event(GATES, "first").set()
        await asyncio.wait_for(first, WAIT_SEC)
        assert not (tmp_path / "late").exists()  # no conversation, no diagnostics: no files

    async def test_grader_deadline(self, tmp_path: Path) -> None:
        """A grader past its deadline fails as timeout, keeping the sample (reward as set)."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=BlockingGrader)
        outcome = await backend.execute(make_request(grader_timeout_sec=0.5))
        result = outcome.reported()
        assert_failure(result, "grader exceeded its 0.5s deadline", RolloutErrorCategory.TIMEOUT)
        assert result.sample is not None
        assert result.sample.reward == 0.25

    async def test_grader_swallowing_its_deadline(self, tmp_path: Path) -> None:
        """A grader that swallows its deadline and returns is still a timeout."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=SwallowingGrader)
        result = (await backend.execute(make_request(grader_timeout_sec=0.3))).reported()
        assert_failure(result, "grader exceeded its 0.3s deadline", RolloutErrorCategory.TIMEOUT)

    async def test_expired_grader_budget(self, tmp_path: Path) -> None:
        """A grader budget of zero or less expires at once."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        result = (await backend.execute(make_request(grader_timeout_sec=-1))).reported()
        assert_failure(result, "grader exceeded its -1.0s deadline", RolloutErrorCategory.TIMEOUT)

    async def test_no_deadline_makes_no_timeout_object(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A rollout without deadlines runs its workflow and grader without an
        asyncio.timeout (each would be held by every rollout in flight)."""
        made: list[float | None] = []
        real_timeout = asyncio.timeout

        def counting(delay: float | None) -> asyncio.Timeout:
            made.append(delay)
            return real_timeout(delay)

        monkeypatch.setattr(asyncio, "timeout", counting)
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request())
        assert outcome.reported().status == RolloutStatus.SUCCESS
        assert made == []

    async def test_grader_budget_is_separate(self, tmp_path: Path) -> None:
        """The grader's deadline does not shrink by the workflow's or the queue's time."""

        class SlowGrader(Grader):
            async def grade(self, ctx: GraderContext) -> None:
                await asyncio.sleep(0.3)
                ctx.set_reward(1.0)

        backend = backend_for(tmp_path, AnswerWorkflow, grader=SlowGrader)
        result = (
            await backend.execute(make_request(agent_timeout_sec=0.2, grader_timeout_sec=5.0))
        ).reported()
        assert result.status == RolloutStatus.SUCCESS


class TestConcurrency:
    async def test_default_limit_is_four(self, tmp_path: Path) -> None:
        """Without a config, four rollouts run and the fifth reports queued until a slot
        frees."""
        backend = backend_for(tmp_path, BlockingWorkflow)
        logs = {f"r{i}": StatusLog() for i in range(5)}
        tasks = [
            asyncio.create_task(backend.execute(make_request(rid, statuses=log, grade=False)))
            for rid, log in logs.items()
        ]
        for rid in ("r0", "r1", "r2", "r3"):
            await logs[rid].wait_for(RolloutStatus.RUNNING)
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        assert backend.health()["concurrency"]["running"] == 4
        assert logs["r4"].seen == [RolloutStatus.QUEUED]
        assert backend.has_capacity()  # unbounded queue: always capacity
        _event(GATES, "r0").set()
        await logs["r4"].wait_for(RolloutStatus.RUNNING)
        for rid in logs:
            _event(GATES, rid).set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_SEC)
        assert backend.health()["concurrency"] | {"max_queued": None} == {
            "max_concurrent": 4,
            "queued": 0,
            "running": 0,
            "max_queued": None,
        }

    async def test_unlimited(self, tmp_path: Path) -> None:
        """A config whose max_concurrent is None runs every rollout at once."""
        backend = backend_for(
            tmp_path, BlockingWorkflow, workflow_config=AgentWorkflowConfig(name="free")
        )
        tasks = [
            asyncio.create_task(backend.execute(make_request(f"u{i}", grade=False)))
            for i in range(10)
        ]
        for i in range(10):
            async with asyncio.timeout(WAIT_SEC):
                await _event(STARTED, f"u{i}").wait()
        assert backend.health()["concurrency"]["running"] == 10
        assert backend.health()["concurrency"]["queued"] == 0
        for i in range(10):
            _event(GATES, f"u{i}").set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_SEC)

    async def test_slot_held_through_grading(self, tmp_path: Path) -> None:
        """A grading rollout keeps its slot: the next one stays queued until grading ends."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(
            tmp_path, AnswerWorkflow, workflow_config=config, grader=BlockingGrader
        )
        first_log, second_log = StatusLog(), StatusLog()
        first = asyncio.create_task(backend.execute(make_request("a", statuses=first_log)))
        await first_log.wait_for(RolloutStatus.GRADING)
        second = asyncio.create_task(
            backend.execute(make_request("b", statuses=second_log, grade=False))
        )
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        assert second_log.seen == [RolloutStatus.QUEUED]
        _event(GATES, "grader:a").set()
        await asyncio.wait_for(first, WAIT_SEC)
        await asyncio.wait_for(second, WAIT_SEC)
        assert second_log.seen == [RolloutStatus.QUEUED, RolloutStatus.RUNNING]


class TestBackpressure:
    async def test_capacity_and_retry_after(self, tmp_path: Path) -> None:
        """With max_queued=1, capacity ends when one rollout waits and returns when it starts."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config, max_queued=1)
        assert backend.has_capacity()
        first = asyncio.create_task(backend.execute(make_request("a", grade=False)))
        await _event(STARTED, "a").wait()
        assert backend.has_capacity()  # the queue is empty
        second = asyncio.create_task(backend.execute(make_request("b", grade=False)))
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        assert not backend.has_capacity()
        # The caller would be second in line: (1 queued + 1) x 5 s assumed / 1 slot.
        assert backend.retry_after_sec() == 10.0
        _event(GATES, "a").set()
        await _event(STARTED, "b").wait()
        assert backend.has_capacity()
        _event(GATES, "b").set()
        await asyncio.wait_for(asyncio.gather(first, second), WAIT_SEC)
        # Both finished quickly after their gates: the measured mean is well under 5 s.
        assert 1.0 <= backend.retry_after_sec() < 5.0

    async def test_zero_max_queued_refuses_when_slots_are_busy(self, tmp_path: Path) -> None:
        """max_queued=0 admits while a slot is free and refuses once all are busy."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config, max_queued=0)
        assert backend.has_capacity()
        task = asyncio.create_task(backend.execute(make_request("a", grade=False)))
        await _event(STARTED, "a").wait()
        assert not backend.has_capacity()
        _event(GATES, "a").set()
        await asyncio.wait_for(task, WAIT_SEC)
        assert backend.has_capacity()

    async def test_retry_after_is_clamped(self, tmp_path: Path) -> None:
        """A long queue gives at most 60 s; no limit gives 1 s."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config, max_queued=100)
        tasks = [
            asyncio.create_task(backend.execute(make_request(f"q{i}", grade=False)))
            for i in range(20)
        ]
        await until(lambda: backend.health()["concurrency"]["queued"] == 19)
        assert backend.retry_after_sec() == 60.0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert backend.health()["concurrency"]["running"] == 0
        unlimited = backend_for(tmp_path, AnswerWorkflow, workflow_config={"name": "free"})
        assert unlimited.retry_after_sec() == 1.0


class TestCancellation:
    async def test_cancel_while_queued(self, tmp_path: Path) -> None:
        """A queued rollout that is cancelled leaves the queue at once and never runs."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config)
        first = asyncio.create_task(backend.execute(make_request("a", grade=False)))
        await _event(STARTED, "a").wait()
        log = StatusLog()
        queued = asyncio.create_task(backend.execute(make_request("b", statuses=log)))
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert backend.health()["concurrency"]["queued"] == 0
        assert log.seen == [RolloutStatus.QUEUED]  # never running
        _event(GATES, "a").set()
        await asyncio.wait_for(first, WAIT_SEC)
        assert "b" not in STARTED
        assert not (tmp_path / "b").exists()

    async def test_cancel_while_running_frees_the_slot(self, tmp_path: Path) -> None:
        """Cancelling a running rollout releases its slot to the next waiter at once."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config)
        running = asyncio.create_task(backend.execute(make_request("a")))
        await _event(STARTED, "a").wait()
        log = StatusLog()
        waiting = asyncio.create_task(backend.execute(make_request("b", statuses=log, grade=False)))
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert backend.health()["concurrency"]["running"] == 1  # the slot went to "b"
        assert backend.health()["concurrency"]["queued"] == 0
        await log.wait_for(RolloutStatus.RUNNING)
        _event(GATES, "b").set()
        await asyncio.wait_for(waiting, WAIT_SEC)
        assert backend.health()["concurrency"]["running"] == 0

    async def test_cancel_while_grading(self, tmp_path: Path) -> None:
        """Cancelling a grading rollout frees the slot and saves a cancelled trajectory."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=BlockingGrader)
        log = StatusLog()
        task = asyncio.create_task(backend.execute(make_request("g", statuses=log)))
        await log.wait_for(RolloutStatus.GRADING)
        await _event(STARTED, "grader:g").wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.health()["concurrency"]["running"] == 0
        await backend.shutdown()
        doc = read_trajectory(tmp_path, "g")
        record = record_of(doc)
        assert (record["status"], record["err_message"]) == ("cancelled", "cancelled")
        assert messages_of(doc) == CONVERSATION
        assert record["phases"]["workflow"]["status"] == "success"

    async def test_swallowed_task_cancellation_is_honoured(self, tmp_path: Path) -> None:
        """A workflow that swallows the task's cancellation ends the rollout as cancelled
        when it returns, and the trajectory is still saved."""
        backend = backend_for(tmp_path, SwallowingWorkflow, grader=HalfGrader)
        task = asyncio.create_task(backend.execute(make_request("s")))
        await _event(STARTED, "s").wait()
        task.cancel()
        await asyncio.sleep(0)
        assert not task.done()  # the workflow is ignoring the cancellation
        _event(GATES, "s").set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_SEC)
        assert backend.health()["concurrency"]["running"] == 0
        await backend.shutdown()
        doc = read_trajectory(tmp_path, "s")
        assert record_of(doc)["status"] == "cancelled"
        assert "reward" not in doc["extra"]["osmosis"]
        assert record_of(doc)["phases"]["grader"] is None


class TestTrajectory:
    async def test_document(self, tmp_path: Path) -> None:
        """The trajectory is an ATIF document of the workflow's conversation (the snapshot,
        not the grader's later edits), written before execute() returns, with the rollout's
        record under ``extra``."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=MutatingGrader)
        request = make_request(
            metadata={"task": "t"},
            request_extra_fields={"dataset": "d"},
            agent_timeout_sec=30.0,
            grader_timeout_sec=20.0,
        )
        outcome = await backend.execute(request)
        doc = read_trajectory(tmp_path, "r1")
        assert set(doc) == {
            "schema_version", "session_id", "trajectory_id", "agent", "steps", "final_metrics",
            "extra",
        }  # fmt: skip
        assert doc["schema_version"] == "ATIF-v1.7"
        assert (doc["session_id"], doc["trajectory_id"]) == ("r1", "r1")
        assert doc["agent"]["name"] == "rollout-server"
        assert messages_of(doc) == CONVERSATION  # the snapshot, without the grader's note
        assert doc["final_metrics"] == {"total_steps": 2}
        assert doc["extra"]["osmosis"] == {
            "rollout_id": "r1",
            "label": "42",
            "reward": 1.0,
            "sample_metrics": {"turns": 1.0},
            "request_metadata": {"task": "t"},
            "request_extra_fields": {"dataset": "d"},
        }
        record = record_of(doc)
        assert set(record) == {
            "status", "err_message", "err_category", "remove_sample", "workflow_info",
            "request", "phases", "timings", "saved_at",
        }  # fmt: skip
        assert (record["status"], record["err_message"], record["err_category"]) == (
            "success",
            None,
            None,
        )
        assert record["remove_sample"] is False
        assert record["workflow_info"] == {"note": "done"}
        assert record["request"] == {
            "agent_timeout_sec": 30.0,
            "grader_timeout_sec": 20.0,
            "grade": True,
        }
        assert record["phases"]["grader"] == {
            "status": "success",
            "err_message": None,
            "err_category": None,
        }
        assert set(record["timings"]) == {"queued_sec", "workflow_sec", "grader_sec", "total_sec"}
        assert all(isinstance(v, float) for v in record["timings"].values())
        assert outcome.reported().sample is not None
        assert not (tmp_path / "r1" / "diagnostics.json").exists()
        # Neither the workflow nor the grader read ctx.artifacts_dir: none was made.
        assert listing(tmp_path / "r1") == ["trajectory.json"]

    async def test_failure_keeps_reward_and_writes_diagnostics(self, tmp_path: Path) -> None:
        """A failed grading saves the original reward, the reported error and a traceback."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=BlockingGrader)
        await backend.execute(make_request(grader_timeout_sec=0.2))
        doc = read_trajectory(tmp_path, "r1")
        record = record_of(doc)
        assert (record["status"], record["err_category"]) == ("failure", "timeout")
        assert doc["extra"]["osmosis"]["reward"] == 0.25
        assert record["err_message"] == "grader exceeded its 0.2s deadline"
        diagnostics = json.loads((tmp_path / "r1" / "diagnostics.json").read_text())
        assert "Traceback" in diagnostics["grader_error"]["traceback"]

    async def test_bare_failure_saves_the_workflow_sample(self, tmp_path: Path) -> None:
        """Without a grader, the reported result is a bare failure but the workflow's
        sample is saved."""
        backend = backend_for(tmp_path, AnswerWorkflow)
        await backend.execute(make_request())
        doc = read_trajectory(tmp_path, "r1")
        record = record_of(doc)
        assert (record["status"], record["err_message"], record["err_category"]) == (
            "failure",
            None,
            None,
        )
        assert messages_of(doc) == CONVERSATION
        assert record["phases"]["grader"] == {
            "status": "failure",
            "err_message": None,
            "err_category": None,
        }

    async def test_no_conversation_no_trajectory(self, tmp_path: Path) -> None:
        """A failed workflow without a sample leaves its diagnostics but no trajectory."""
        backend = backend_for(tmp_path, RaisingWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request())
        assert outcome.reported().status == RolloutStatus.FAILURE
        assert listing(tmp_path / "r1") == ["diagnostics.json"]

    async def test_non_json_values_are_dropped(self, tmp_path: Path) -> None:
        """Telemetry JSON cannot hold is dropped from the file; the rollout is unaffected."""

        class Odd(AgentWorkflow):
            async def run(self, ctx: WorkflowContext) -> None:
                sample = Sample(
                    messages=[{"role": "assistant", "content": "a", "odd": object()}],
                    metrics={"bad": float("nan"), "ok": 1, "obj": object()},
                )
                get_rollout_context().register_sample_source(lambda: sample)

        backend = backend_for(tmp_path, Odd, grader=HalfGrader)
        outcome = await backend.execute(make_request())
        assert outcome.reported().status == RolloutStatus.SUCCESS
        doc = read_trajectory(tmp_path, "r1")
        assert doc["extra"]["osmosis"]["sample_metrics"] == {"ok": 1}
        # The message key JSON cannot hold was kept in the step's extra, then dropped.
        assert doc["steps"] == [{"step_id": 1, "source": "agent", "message": "a", "extra": {}}]
        assert doc["extra"]["osmosis"]["reward"] == 0.5

    async def test_write_failure_never_changes_the_result(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A failing trajectory write is logged and the outcome is returned unchanged."""

        def broken(*_args: Any) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(trajectory_module, "write_rollout_files", broken)
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        with caplog.at_level(logging.WARNING, logger="rollout_server"):
            outcome = await backend.execute(make_request())
        assert isinstance(outcome, ExecutionOutcome)
        assert outcome.reported().status == RolloutStatus.SUCCESS
        assert "cannot save the trajectory: disk full" in caplog.text

    async def test_a_hung_write_is_bounded(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """When file jobs run in a worker thread and the trajectory write hangs, the
        outcome is returned once FILE_JOB_TIMEOUT_SEC has passed, with a WARNING."""
        monkeypatch.setattr(trajectory_module, "FILE_JOB_TIMEOUT_SEC", 0.05)
        # Every job counts as stalled: file jobs run in a worker thread from the first on.
        monkeypatch.setattr(
            trajectory_module,
            "BatchOffloader",
            functools.partial(trajectory_module.BatchOffloader, stall_sec=0.0),
        )
        release = threading.Event()

        def hung(*_args: Any) -> None:
            release.wait(timeout=30)

        monkeypatch.setattr(trajectory_module, "write_rollout_files", hung)
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        try:
            with caplog.at_level(logging.WARNING, logger="rollout_server"):
                async with asyncio.timeout(30):
                    outcome = await backend.execute(make_request())
        finally:
            release.set()
        assert outcome.reported().status == RolloutStatus.SUCCESS
        assert "cannot save the trajectory: the file job did not finish" in caplog.text

    async def test_unsafe_id_skips_files(self, tmp_path: Path) -> None:
        """An id that is not one path segment gets no directory and no trajectory."""

        seen: list[Any] = []

        class Probe(AgentWorkflow):
            async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
                seen.append(ctx.artifacts_dir)
                return [ANSWER]

        backend = LocalBackend(Probe, artifact_root=tmp_path)
        outcome = await backend.execute(make_request("../escape", grade=False))
        assert outcome.workflow.status == RolloutStatus.SUCCESS
        assert seen == [None]
        assert listing(tmp_path) == []
