"""LocalBackend.execute(): the contexts a workflow and a grader see (workflow, grader and
ambient rollout context) and their artifacts directory, called directly (no HTTP)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    Grader,
    GraderContext,
    LocalBackend,
    RolloutContext,
    WorkflowContext,
    current_rollout_context,
)
from rollout_server.execution import _trajectory as trajectory_module
from rollout_server.execution._context import bind_rollout_context
from rollout_types import RolloutStatus

from .local_backend_helpers import (
    ANSWER,
    PROMPT,
    AnswerWorkflow,
    ContextGrader,
    ContextWorkflow,
    backend_for,
    make_request,
    read_trajectory,
    record_of,
    reset_tables,  # noqa: F401 - an autouse fixture
)


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
