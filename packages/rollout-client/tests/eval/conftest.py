"""An in-memory stand-in for a rollout server and its client, for the runner's unit tests."""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path
from typing import Any

import pytest

from rollout_types import RolloutResultResponse, RolloutSample

Behaviour = Callable[[dict[str, Any], asyncio.Event], Awaitable[RolloutResultResponse]]


def success(rollout_id: str, reward: float, *, remove: bool = False) -> RolloutResultResponse:
    """A ``success`` result with ``reward``."""
    return RolloutResultResponse(
        rollout_id=rollout_id,
        status="success",
        sample=RolloutSample(
            messages=[{"role": "assistant", "content": "x"}],
            reward=None if remove else reward,
            remove_sample=remove,
        ),
    )


def failure(rollout_id: str, category: str | None, message: str) -> RolloutResultResponse:
    """A ``failure`` result."""
    return RolloutResultResponse(
        rollout_id=rollout_id, status="failure", err_category=category, err_message=message
    )


class FakeHandle:
    """Awaitable like ``RolloutHandle``: resolves to the behaviour's result."""

    def __init__(self, rollout_id: str, task: asyncio.Task[RolloutResultResponse]) -> None:
        self.rollout_id = rollout_id
        self._task = task

    def __await__(self) -> Generator[Any, None, RolloutResultResponse]:
        return asyncio.shield(self._task).__await__()

    def cancel(self) -> bool:
        return self._task.cancel()

    def done(self) -> bool:
        return self._task.done()


class FakeServer:
    """Runs each admitted rollout's behaviour as a task; records requests and cancels."""

    def __init__(
        self,
        behaviour: Behaviour,
        *,
        health: dict[str, Any] | None = None,
        admit: Callable[[dict[str, Any]], None] | None = None,
        admit_gate: asyncio.Event | None = None,
    ) -> None:
        self.behaviour = behaviour
        self.admit = admit
        self.admit_gate = admit_gate
        self.health_body = health or {
            "status": "ok",
            "concurrency": {"max_concurrent": 3, "queued": 0, "running": 0},
        }
        self.requests: list[dict[str, Any]] = []
        self.cancel_requests: list[str] = []
        self.cancel_events: dict[str, asyncio.Event] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.client_kwargs: list[dict[str, Any]] = []
        self.closed = 0

    def factory(self, **kwargs: Any) -> FakeClient:
        self.client_kwargs.append(kwargs)
        return FakeClient(self)

    async def _run(self, request: dict[str, Any]) -> RolloutResultResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.behaviour(request, self.cancel_events[request["rollout_id"]])
        finally:
            self.in_flight -= 1


class FakeClient:
    """The subset of ``RolloutClient`` the runner uses."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server

    async def health(self) -> dict[str, Any]:
        return self.server.health_body

    async def run_rollout_async(self, **request: Any) -> FakeHandle:
        if self.server.admit is not None:
            self.server.admit(request)
        if self.server.admit_gate is not None:
            await self.server.admit_gate.wait()
        self.server.requests.append(request)
        self.server.cancel_events[request["rollout_id"]] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self.server._run(request))
        return FakeHandle(request["rollout_id"], task)

    async def cancel_rollout(self, rollout_id: str) -> dict[str, str]:
        self.server.cancel_requests.append(rollout_id)
        self.server.cancel_events[rollout_id].set()
        return {rollout_id: "cancelled_running"}

    async def aclose(self) -> None:
        self.server.closed += 1


async def until_cancelled(
    request: dict[str, Any], cancelled: asyncio.Event
) -> RolloutResultResponse:
    """A rollout that runs until the server is asked to cancel it."""
    await cancelled.wait()
    return RolloutResultResponse(rollout_id=request["rollout_id"], status="cancelled")


@pytest.fixture
def fakes() -> types.SimpleNamespace:
    """The fake server, client and result builders of this module."""
    return types.SimpleNamespace(
        FakeServer=FakeServer,
        success=success,
        failure=failure,
        until_cancelled=until_cancelled,
    )


def write_dataset(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` as a JSONL dataset."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """A valid five-row JSONL dataset (labels "0" .. "4")."""
    return write_dataset(
        tmp_path / "tiny.jsonl",
        [{"user_prompt": f"What is {i} + 0?", "label": str(i)} for i in range(5)],
    )
