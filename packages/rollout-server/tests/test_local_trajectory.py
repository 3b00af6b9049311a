"""LocalBackend.execute(): the trajectory document and diagnostics it saves per rollout,
called directly (no HTTP)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from rollout_server import (
    AgentWorkflow,
    ExecutionOutcome,
    LocalBackend,
    Sample,
    WorkflowContext,
    get_rollout_context,
)
from rollout_server.execution import _trajectory as trajectory_module
from rollout_types import RolloutStatus

from .local_backend_helpers import (
    ANSWER,
    CONVERSATION,
    AnswerWorkflow,
    BlockingGrader,
    HalfGrader,
    MutatingGrader,
    RaisingWorkflow,
    backend_for,
    listing,
    make_request,
    messages_of,
    read_trajectory,
    record_of,
    reset_tables,  # noqa: F401 - an autouse fixture
)


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
