"""``LocalBackend``: run agent workflows and graders in the server's own process.

One rollout, as :meth:`LocalBackend.execute` runs it (wire-protocol section 5.3):

1. Wait for a concurrency slot (status ``queued``); the agent deadline already counts, and a
   rollout whose deadline passes in the queue fails as ``timeout`` without taking a slot.
2. Holding the slot (status ``running``): create ``<artifact_root>/<id>/`` and run the
   workflow within what is left of ``agent_timeout_sec`` (``artifacts/`` inside is created
   when the workflow or grader first reads ``ctx.artifacts_dir``).
3. Grade (status ``grading``) when ``grade`` is true, the workflow succeeded, a grader is
   configured and the request has a ``label`` or ``metadata``; within
   ``grader_timeout_sec``. The slot is held through grading.
4. Release the slot, save ``trajectory.json`` (and ``diagnostics.json``), return.

Cancellation at any point releases the slot at once and propagates. Each phase's time goes
to ``request.observer`` (the server's metrics) as it ends, and, when the server traces,
each phase is a span (``queue``, ``workflow``, ``grading``, ``trajectory write``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

from rollout_types import RolloutStatus

from ._backend import ExecutionOutcome, ExecutionRequest, ExecutionResult
from ._context import RolloutContext, bind_rollout_context, current_rollout_context
from ._grader import Grader, GraderConfig
from ._imports import resolve_class, resolve_config
from ._lazydir import LazyDirectory
from ._limiter import ConcurrencyLimiter
from ._phases import Phase, PhaseRunner, RolloutRun, timed_out
from ._slot_backend import SlotBackend
from ._trajectory import RolloutFacts, RolloutFiles, default_artifact_root
from ._workflow import AgentWorkflow, AgentWorkflowConfig

__all__ = ["DEFAULT_MAX_CONCURRENT", "LocalBackend"]

DEFAULT_MAX_CONCURRENT: Final = 4
"""Slot count of a LocalBackend built without a workflow config."""

SHUTDOWN_PERSIST_WAIT_SEC: Final = 10.0
"""Longest :meth:`LocalBackend.shutdown` waits for trajectory writes still in flight."""


class LocalBackend(SlotBackend[Literal[True]]):
    """Run an :class:`~rollout_server.AgentWorkflow` (and a grader) in this process.

    Args:
        workflow: The workflow class, or an import string ``"package.module:Attr"``.
        workflow_config: An :class:`~rollout_server.AgentWorkflowConfig`, a mapping for
            :meth:`~rollout_server.AgentWorkflowConfig.from_mapping`, an import string
            naming either, or None. Its ``concurrency.max_concurrent`` is the slot count
            (None: no limit); without a config the limit is 4.
        grader: The grader class, an import string, or None (no grading: a graded request
            then fails with every field null, as osmosis-ai does).
        grader_config: A :class:`~rollout_server.GraderConfig`, a mapping, an import string,
            or None; handed to every grader instance as is.
        max_queued: With a limit, the most rollouts that may wait for a slot: when that many
            wait (and no slot is free), :meth:`has_capacity` is False and admission answers
            429 with :meth:`retry_after_sec`. None (the default) queues without bound; 0
            refuses whenever every slot is busy.
        artifact_root: Directory under which each rollout's files go; default
            ``$ROLLOUT_ARTIFACT_ROOT``, else ``$_OSMOSIS_ROLLOUT_ARTIFACT_ROOT``, else
            ``$XDG_STATE_HOME/rollout/artifacts`` or ``~/.local/state/rollout/artifacts``
            (read once, here).

    Raises:
        ValueError: On a malformed import string, an invalid ``max_queued``, or a
            ``max_queued`` without a concurrency limit.
        ImportError: When an import string names a missing module or attribute.
        TypeError: When ``workflow``/``grader`` is not a concrete subclass of the base
            class, or a config is not a config.
    """

    def __init__(
        self,
        workflow: type[AgentWorkflow] | str,
        *,
        workflow_config: AgentWorkflowConfig | Mapping[str, Any] | str | None = None,
        grader: type[Grader] | str | None = None,
        grader_config: GraderConfig | Mapping[str, Any] | str | None = None,
        max_queued: int | None = None,
        artifact_root: str | os.PathLike[str] | None = None,
    ) -> None:
        workflow_cls: type[AgentWorkflow] = resolve_class(workflow, AgentWorkflow, "workflow")
        config = resolve_config(workflow_config, AgentWorkflowConfig, "workflow_config")
        grader_cls: type[Grader] | None = (
            None if grader is None else resolve_class(grader, Grader, "grader")
        )
        self._phases = PhaseRunner(
            workflow_cls,
            config,
            grader_cls,
            resolve_config(grader_config, GraderConfig, "grader_config"),
        )
        limit = DEFAULT_MAX_CONCURRENT if config is None else config.concurrency.max_concurrent
        super().__init__(slots=limit, max_queued=max_queued)
        self._limiter = ConcurrencyLimiter(limit)
        self._files = RolloutFiles(
            default_artifact_root()
            if artifact_root is None
            else Path(artifact_root).expanduser().absolute()
        )

    @property
    def max_concurrent(self) -> int | None:
        """The slot count, or None for no limit."""
        return self._limiter.max_concurrent

    @property
    def artifact_root(self) -> Path:
        """The absolute directory under which each rollout's files go."""
        return self._files.root

    # -- slots (SlotBackend) ----------------------------------------------------------

    def _load(self) -> tuple[int, int]:
        return self._limiter.running, self._limiter.queued

    def _take_slot(self) -> Literal[True] | None:
        return True if self._limiter.take() else None

    async def _wait_for_slot(self, deadline: float | None) -> Literal[True] | None:
        if deadline is None:
            await self._limiter.acquire()
            return True
        try:
            async with asyncio.timeout_at(deadline):
                await self._limiter.acquire()
        except TimeoutError:
            return None
        return True

    # -- ExecutionBackend -------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``{"status": "ok", "concurrency": {"max_concurrent", "queued", "running",
        "max_queued"}}``."""
        return {"status": "ok", "concurrency": self._concurrency()}

    async def shutdown(self) -> None:
        """Wait (up to 10 s) for trajectory writes still in flight (those of cancelled
        rollouts, and any that outlasted their rollout's 10 s wait)."""
        await self._files.wait_for_writes(SHUTDOWN_PERSIST_WAIT_SEC)

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        """Run one rollout: slot, workflow, grading, trajectory (module docstring).

        Binds an ambient :class:`~rollout_server.RolloutContext` built from ``request``
        unless the caller (the server) already bound one for this rollout. Queue time counts
        from ``request.admitted_at`` (the server's admission stamp), or from the call of this
        method when the request has no stamp (0) or one in the future.

        Args:
            request: The admitted rollout.

        Returns:
            The workflow result, and the grader result when grading ran or was due.

        Raises:
            asyncio.CancelledError: When the task is cancelled, including a cancellation
                that user code swallowed (reported once that code returns).
        """
        run = RolloutRun.start(request)
        ambient = current_rollout_context()
        binding: contextlib.AbstractContextManager[RolloutContext]
        if ambient is None or ambient.rollout_id != request.id:
            ambient = RolloutContext.from_request(
                rollout_id=request.id,
                chat_completions_url=request.chat_completions_url,
                llm_api_key=request.llm_api_key,
                process_id="",
                on_status=request.on_status,
            )
            binding = bind_rollout_context(ambient)
        else:
            binding = contextlib.nullcontext(ambient)  # the server bound it already
        run.route = ambient.model_route
        try:
            with binding:
                outcome = await self._execute(run, ambient)
        except asyncio.CancelledError:
            self._persist_cancelled(run)
            raise
        # Saved before the result is returned (and so published): a caller that sees it can
        # read the file.
        await self._files.save(self._facts(run, outcome))
        return outcome

    # -- phases -----------------------------------------------------------------------

    async def _execute(self, run: RolloutRun, ambient: RolloutContext) -> ExecutionOutcome:
        request = run.request
        if not await self._queue_for_slot(run):
            run.workflow = timed_out(run, Phase.WORKFLOW)
            return ExecutionOutcome(workflow=run.workflow)
        held_from = time.monotonic()
        finished = False
        try:
            request.on_status(RolloutStatus.RUNNING)
            artifacts = await self._files.prepare(request.id)
            artifacts_dir = None if artifacts is None else LazyDirectory(artifacts)
            phases = self._phases
            run.workflow = await phases.run(run, Phase.WORKFLOW, artifacts_dir, ambient)
            run.check_cancelled()
            if not request.grade or run.workflow.status != RolloutStatus.SUCCESS:
                finished = True
                return ExecutionOutcome(workflow=run.workflow)
            if phases.grader_cls is None or (request.label is None and request.metadata is None):
                # Nothing to grade with: a bare failure, which the server reports (5.3).
                run.grader = ExecutionResult(status=RolloutStatus.FAILURE)
            else:
                request.on_status(RolloutStatus.GRADING)
                run.grader = await phases.run(
                    run, Phase.GRADER, artifacts_dir, ambient, run.workflow.sample
                )
                run.check_cancelled()
            finished = True
            return ExecutionOutcome(workflow=run.workflow, grader=run.grader)
        finally:
            self._limiter.release()
            if finished:
                self._slot_held_for(time.monotonic() - held_from)

    @staticmethod
    def _facts(
        run: RolloutRun, outcome: ExecutionOutcome, reported: ExecutionResult | None = None
    ) -> RolloutFacts:
        return RolloutFacts(
            request=run.request,
            outcome=outcome,
            reported=reported,
            timings=run.timings(),
            workflow_info=run.workflow_info,
            turns=() if run.route is None else tuple(run.route.turns),
        )

    def _persist_cancelled(self, run: RolloutRun) -> None:
        """Save the trajectory of a cancelled rollout that has a sample, in the background,
        so that the cancellation propagates at once."""
        workflow = run.workflow
        if workflow is None or workflow.sample is None:
            return
        cancelled = ExecutionResult(status=RolloutStatus.CANCELLED, err_message="cancelled")
        outcome = ExecutionOutcome(workflow=workflow, grader=run.grader)
        self._files.save_soon(self._facts(run, outcome, cancelled))
