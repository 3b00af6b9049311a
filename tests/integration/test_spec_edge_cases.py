"""Edge cases of wire-protocol section 9 that need our client and our server together.

Each class names the section 9 item it pins down; ``tests/SPEC_COVERAGE.md`` maps every
item to its tests.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_client import RolloutClient, RolloutProtocolError
from rollout_client.testing import override_timing
from rollout_server import (
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    Sample,
)
from rollout_types import RolloutStatus

from .conftest import EVENT_SEC

MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]


class RefusingBackend(ExecutionBackend):
    """Runs each rollout until its gate opens; refuses ``refusals`` admissions (429)."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.refusals = 0
        self.capacity_checks = 0

    def gate(self, rollout_id: str) -> asyncio.Event:
        return self.gates.setdefault(rollout_id, asyncio.Event())

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        await self.gate(request.id).wait()
        sample = Sample(messages=[{"role": "assistant", "content": "42"}], reward=1.0)
        return ExecutionOutcome(
            workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample)
        )

    def has_capacity(self) -> bool:
        self.capacity_checks += 1
        if self.refusals > 0:
            self.refusals -= 1
            return False
        return True

    def retry_after_sec(self) -> float:
        return 2.0

    def release(self) -> None:
        for event in self.gates.values():
            event.set()


@pytest.fixture
async def setup(serve_rollout):
    """A served RefusingBackend and a client whose backoff sleeps are recorded, not slept."""
    backend = RefusingBackend()
    server = await serve_rollout(backend)
    sleeps: list[float] = []

    async def record(delay: float) -> None:
        sleeps.append(delay)
        await asyncio.sleep(0)

    async with RolloutClient(url=server.url) as client:
        override_timing(client, sleep=record)
        yield backend, server, client, sleeps
        backend.release()


class TestItem01DuplicateAtCapacity:
    async def test_client_waits_out_429_then_gets_409(self, setup):
        """A duplicate id sent while the server is full is answered 429 (the client waits the
        Retry-After) and then 409 once capacity is back, which the client raises."""
        backend, _server, client, sleeps = setup
        handle = await client.run_rollout_async(MESSAGES, "u", "dup")
        backend.refusals = 1
        with pytest.raises(RolloutProtocolError) as e:
            async with asyncio.timeout(EVENT_SEC):
                await client.run_rollout_async(MESSAGES, "u", "dup")
        assert e.value.status_code == 409
        assert sleeps == [2.0]
        backend.release()
        async with asyncio.timeout(EVENT_SEC):
            assert (await handle).status == RolloutStatus.SUCCESS


class TestItem02ShuttingDown:
    async def test_client_treats_503_on_admission_as_fatal(self, setup):
        """Once our server has begun shutting down, our client's admission fails at once with
        RolloutProtocolError(503): no retry, nothing admitted."""
        backend, server, client, sleeps = setup
        server.state.begin_shutdown()
        with pytest.raises(RolloutProtocolError, match="returned 503") as e:
            async with asyncio.timeout(EVENT_SEC):
                await client.run_rollout_async(MESSAGES, "u", "late")
        assert e.value.status_code == 503
        assert sleeps == []
        assert backend.capacity_checks == 0
        assert server.state.registry.get("late") is None
