"""LocalBackend.execute(): what a rollout returns (wire-protocol section 5.7 at the backend
level) and what a workflow may return, called directly (no HTTP)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_server import (
    AgentWorkflow,
    Sample,
    WorkflowContext,
    get_rollout_context,
)
from rollout_types import RolloutErrorCategory, RolloutStatus

from .local_backend_helpers import (
    ANSWER,
    PROMPT,
    AnswerWorkflow,
    BadListWorkflow,
    BadReturnWorkflow,
    ContextGrader,
    HalfGrader,
    ListWorkflow,
    NoMessagesWorkflow,
    NoneWorkflow,
    RaisingGrader,
    RaisingWorkflow,
    RemovingGrader,
    SilentGrader,
    SourceWorkflow,
    StatusLog,
    assert_failure,
    backend_for,
    make_request,
    reset_tables,  # noqa: F401 - an autouse fixture
)


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
