"""The user guide's examples, run as written (aiohttp session, our import names) against
``create_rollout_server(LocalBackend(...))`` on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Final
from uuid import uuid4

import aiohttp
import pytest
from aiohttp import web

from rollout_client import RolloutClient, RolloutHandle, RolloutProtocolError
from rollout_server import (
    AgentWorkflow,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
    create_rollout_server,
)
from rollout_types import RolloutResultResponse, RolloutStatus

from .conftest import EVENT_SEC, FAST_TIMINGS


class Calculator(AgentWorkflow):
    """Answers the arithmetic question; blocks on ``Calculator.gate`` when metadata asks."""

    gate: asyncio.Event | None = None
    started: asyncio.Event | None = None

    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        if ctx.metadata and ctx.metadata.get("block"):
            assert Calculator.gate is not None
            assert Calculator.started is not None
            Calculator.started.set()
            await Calculator.gate.wait()
        return [*ctx.prompt, {"role": "assistant", "content": "42"}]


class ExactMatch(Grader):
    """Reward 1.0 when the last message's content equals the label, else 0.0."""

    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        ctx.set_reward(1.0 if ctx.sample.messages[-1]["content"] == ctx.label else 0.0)


@pytest.fixture
def backend(tmp_path) -> LocalBackend:
    """A LocalBackend running the calculator with an exact-match grader."""
    Calculator.gate = asyncio.Event()
    Calculator.started = asyncio.Event()
    return LocalBackend(Calculator, grader=ExactMatch, artifact_root=tmp_path)


class HeldCalculator(Calculator):
    """The calculator, held until the test sets ``HeldCalculator.release``."""

    started: asyncio.Event | None = None
    release: asyncio.Event | None = None

    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        assert HeldCalculator.started is not None
        assert HeldCalculator.release is not None
        HeldCalculator.started.set()
        await HeldCalculator.release.wait()
        return await super().run(ctx)


class HeldExactMatch(ExactMatch):
    """The exact-match grader, held until the test sets ``HeldExactMatch.release``."""

    started: asyncio.Event | None = None
    release: asyncio.Event | None = None

    async def grade(self, ctx: GraderContext) -> None:
        assert HeldExactMatch.started is not None
        assert HeldExactMatch.release is not None
        HeldExactMatch.started.set()
        await HeldExactMatch.release.wait()
        await super().grade(ctx)


@pytest.fixture
def held_backend(tmp_path) -> LocalBackend:
    """A LocalBackend whose workflow and grader each run until the test releases them:
    a rollout that lasts as long as the test needs, whatever the machine's speed."""
    for held in (HeldCalculator, HeldExactMatch):
        held.started = asyncio.Event()
        held.release = asyncio.Event()
    return LocalBackend(HeldCalculator, grader=HeldExactMatch, artifact_root=tmp_path)


DEFAULT_TIMINGS: Final[dict[str, float]] = {
    "result_wait_timeout_sec": 30.0,
    "polling_lease_timeout_sec": 120.0,
}
"""The server's own default timings: a poll that missed a change would wait 30 s, longer
than :data:`EVENT_SEC` bounds any step."""


def answered_statuses(app: web.Application) -> list[str]:
    """The status of every 200 the app answers to a result poll, in order (filled as the
    app serves)."""
    statuses: list[str] = []

    async def note(request: web.Request, response: web.StreamResponse) -> None:
        if (
            request.method == "GET"
            and request.path.endswith("/result")
            and response.status == 200
            and isinstance(response, web.Response)
            and isinstance(response.body, bytes)
        ):
            statuses.append(json.loads(response.body)["status"])

    app.on_response_prepare.append(note)
    return statuses


class HandleCatchingClient(RolloutClient):
    """A RolloutClient that hands each handle it creates to the test (``handles``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handles: asyncio.Queue[RolloutHandle] = asyncio.Queue()

    async def run_rollout_async(self, *args: Any, **kwargs: Any) -> RolloutHandle:
        handle = await super().run_rollout_async(*args, **kwargs)
        self.handles.put_nowait(handle)
        return handle


# --- the user guide's example ('Track Progress with a Rollout Handle') ---
async def track_rollout(
    client: RolloutClient,
    chat_completions_url: str,
    llm_api_key: str | None = None,
) -> RolloutResultResponse:
    rollout = await client.run_rollout_async(
        initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
        chat_completions_url=chat_completions_url,
        rollout_id=str(uuid4()),
        llm_api_key=llm_api_key,
        label="42",
        grade=True,
    )
    phase = await rollout.wait_for_grading()
    print(phase)
    return await rollout


# ---


class TestUserGuideExamples:
    async def test_run_to_completion(self, serve_rollout, backend, capsys, monkeypatch):
        """'Run a Rollout to Completion' prints the success status and the reward."""
        server = await serve_rollout(backend)
        monkeypatch.delenv("ROLLOUT_LLM_API_KEY", raising=False)

        # --- the user guide's example, with an aiohttp session ---
        async def main() -> None:
            async with aiohttp.ClientSession() as http_client:
                client = RolloutClient(
                    url=server.url,
                    http_client=http_client,
                    admission_timeout_sec=60,
                )
                result = await client.run_rollout(
                    initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
                    chat_completions_url="http://127.0.0.1:9000/v1",
                    rollout_id=str(uuid4()),
                    llm_api_key=os.environ.get("ROLLOUT_LLM_API_KEY"),
                    label="42",
                    grade=True,
                )
                print(result.status, result.sample.reward if result.sample else None)

        # ---
        async with asyncio.timeout(EVENT_SEC):
            await main()
        assert capsys.readouterr().out == "success 1.0\n"

    async def test_track_progress_with_handle(self, serve_rollout, backend, capsys):
        """'Track Progress with a Rollout Handle' prints a phase and returns the result."""
        server = await serve_rollout(backend)

        async with RolloutClient(url=server.url) as client, asyncio.timeout(EVENT_SEC):
            result = await track_rollout(client, "http://127.0.0.1:9000/v1")
        assert result.status == RolloutStatus.SUCCESS
        assert result.sample is not None
        assert result.sample.reward == 1.0
        assert not hasattr(result.sample, "trajectory_messages")
        assert capsys.readouterr().out.strip() in {"grading", "success"}

    async def test_cancel_and_wait(self, serve_rollout, backend):
        """'Cancel a Rollout': cancel by id, keep polling, observe the cancelled result."""
        server = await serve_rollout(backend)

        # --- the user guide's example ---
        async def cancel_and_wait(
            client: RolloutClient, rollout: RolloutHandle
        ) -> RolloutResultResponse:
            await client.cancel_rollout(rollout.rollout_id)
            return await rollout

        # ---
        async with RolloutClient(url=server.url) as client, asyncio.timeout(EVENT_SEC):
            rollout = await client.run_rollout_async(
                initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
                chat_completions_url="http://127.0.0.1:9000/v1",
                rollout_id=str(uuid4()),
                metadata={"block": True},
            )
            assert Calculator.started is not None
            await Calculator.started.wait()
            assert await rollout.wait_for_running() == RolloutStatus.RUNNING
            result = await cancel_and_wait(client, rollout)
        assert result.status == RolloutStatus.CANCELLED
        assert result.rollout_id == rollout.rollout_id

    async def test_authenticate(self, serve_app, backend, monkeypatch):
        """'Authenticate to the Rollout Server': the key works; no key gets 401 everywhere."""
        monkeypatch.setenv("ROLLOUT_SERVER_API_KEY", "s3cret-key")

        # --- the user guide's example ---
        app = create_rollout_server(
            backend=backend,
            api_key=os.environ["ROLLOUT_SERVER_API_KEY"],
            **FAST_TIMINGS,
        )
        # ---
        running = await serve_app(app)

        # --- the user guide's example ---
        client = RolloutClient(
            url=running.url,
            api_key=os.environ["ROLLOUT_SERVER_API_KEY"],
        )
        # ---
        try:
            async with asyncio.timeout(EVENT_SEC):
                result = await client.run_rollout(
                    [{"role": "user", "content": "What is 6 * 7?"}],
                    "http://127.0.0.1:9000/v1",
                    str(uuid4()),
                    label="42",
                )
                assert result.status == RolloutStatus.SUCCESS
                assert (await client.health())["lifecycle"]["active_rollouts"] >= 0
        finally:
            await client.aclose()

        async with RolloutClient(url=running.url) as anonymous:
            with pytest.raises(RolloutProtocolError) as e:
                await anonymous.health()
            assert e.value.status_code == 401
            with pytest.raises(RolloutProtocolError, match="api_key") as e:
                await anonymous.run_rollout_async([], "u", "r1")
            assert e.value.status_code == 401

        async with RolloutClient(url=running.url, api_key="wrong") as wrong:
            with pytest.raises(RolloutProtocolError) as e:
                await wrong.cancel_rollout("r1")
            assert e.value.status_code == 401

    async def test_wait_until_idle(self, serve_rollout, backend):
        """'Check Health and Wait for Idle Work': pinned wait returns once work finishes."""
        server = await serve_rollout(backend)

        # --- the user guide's example ---
        async def wait_until_idle(client: RolloutClient) -> None:
            health = await client.health()
            await client.wait_idle(timeout_sec=120, process_id=health["process_id"])

        # ---
        async with RolloutClient(url=server.url) as client, asyncio.timeout(EVENT_SEC):
            rollout = await client.run_rollout_async(
                [{"role": "user", "content": "What is 6 * 7?"}],
                "http://127.0.0.1:9000/v1",
                str(uuid4()),
                metadata={"block": True},
            )
            assert Calculator.started is not None
            await Calculator.started.wait()
            health = await client.health()
            assert health["lifecycle"]["active_rollouts"] == 1
            waiter = asyncio.create_task(wait_until_idle(client))
            await asyncio.sleep(0)
            assert not waiter.done()
            assert Calculator.gate is not None
            Calculator.gate.set()
            await waiter
            assert (await rollout).status == RolloutStatus.SUCCESS
            assert (await client.health())["lifecycle"]["active_rollouts"] == 0


class TestMilestones:
    """The guide's handle sees each phase that lasts longer than the status-change grace,
    with the server's default timings (30 s wait, 1 s grace)."""

    async def test_track_rollout_sees_running_then_grading(self, serve_app, held_backend, capsys):
        """track_rollout's handle reports running while the workflow is held and grading
        while the grader is held (wait_for_running() and wait_for_grading() return them
        before either is released), then the result: one poll answer per phase."""
        app = create_rollout_server(backend=held_backend, **DEFAULT_TIMINGS)
        statuses = answered_statuses(app)
        server = await serve_app(app)
        async with HandleCatchingClient(url=server.url) as client, asyncio.timeout(EVENT_SEC):
            tracked = asyncio.create_task(track_rollout(client, "http://127.0.0.1:9000/v1"))
            handle = await client.handles.get()
            assert handle.status == RolloutStatus.QUEUED
            assert await handle.wait_for_running() == RolloutStatus.RUNNING
            assert handle.latest_result is not None
            assert handle.latest_result.status == RolloutStatus.RUNNING
            assert HeldCalculator.started is not None
            assert HeldCalculator.started.is_set()
            assert HeldCalculator.release is not None
            HeldCalculator.release.set()
            assert await handle.wait_for_grading() == RolloutStatus.GRADING
            assert HeldExactMatch.started is not None
            assert HeldExactMatch.started.is_set()
            assert not tracked.done()
            assert HeldExactMatch.release is not None
            HeldExactMatch.release.set()
            result = await tracked
        assert result.status == RolloutStatus.SUCCESS
        assert result.sample is not None
        assert result.sample.reward == 1.0
        assert capsys.readouterr().out == "grading\n"
        assert statuses == ["running", "grading", "success"]

    async def test_a_quick_rollout_is_answered_in_one_round_trip(self, serve_app, backend):
        """A rollout that finishes within the grace of its first poll is answered with its
        result by that one poll (not running first): one result request."""
        app = create_rollout_server(
            backend=backend, status_change_grace_sec=EVENT_SEC, **DEFAULT_TIMINGS
        )
        statuses = answered_statuses(app)
        server = await serve_app(app)
        async with RolloutClient(url=server.url) as client, asyncio.timeout(EVENT_SEC):
            result = await track_rollout(client, "http://127.0.0.1:9000/v1")
        assert result.status == RolloutStatus.SUCCESS
        assert statuses == ["success"]
