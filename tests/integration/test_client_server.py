"""``RolloutClient`` end to end against our ``rollout_server`` on 127.0.0.1."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_client import RolloutClient, RolloutProtocolError, RolloutProtocolVersionError
from rollout_client.testing import override_timing
from rollout_server import (
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    Sample,
)
from rollout_types import (
    PROTOCOL_VERSION_HEADER,
    CancelDisposition,
    RolloutStatus,
)

from .conftest import EVENT_SEC

MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]


class GatedBackend(ExecutionBackend):
    """Runs each rollout until the test opens its gate; may refuse admission (429)."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.cancelled: set[str] = set()
        self.full = False

    def _events(self, rollout_id: str) -> tuple[asyncio.Event, asyncio.Event]:
        gate = self.gates.setdefault(rollout_id, asyncio.Event())
        started = self.started.setdefault(rollout_id, asyncio.Event())
        return gate, started

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        gate, started = self._events(request.id)
        started.set()
        try:
            await gate.wait()
        except asyncio.CancelledError:
            self.cancelled.add(request.id)
            raise
        sample = Sample(messages=[{"role": "assistant", "content": "42"}], reward=1.0)
        return ExecutionOutcome(
            workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample)
        )

    def has_capacity(self) -> bool:
        if self.full:
            self.full = False  # refuse once
            return False
        return True

    def retry_after_sec(self) -> float:
        return 1.0

    async def wait_started(self, rollout_id: str) -> None:
        async with asyncio.timeout(EVENT_SEC):
            await self._events(rollout_id)[1].wait()

    def open(self, rollout_id: str) -> None:
        self._events(rollout_id)[0].set()


@pytest.fixture
async def gated(serve_rollout):
    backend = GatedBackend()
    server = await serve_rollout(backend)
    async with RolloutClient(url=server.url) as client:
        yield backend, server, client


class TestEndToEnd:
    @pytest.mark.parametrize("rollout_id", ["a b", "a?b#c", "100%", "a%2Fb", "é-ü", "x:y"])
    async def test_percent_encoded_ids(self, gated, rollout_id):
        """Ids with URL-significant characters are admitted and polled by the same id."""
        backend, _server, client = gated
        backend.open(rollout_id)
        async with asyncio.timeout(EVENT_SEC):
            result = await client.run_rollout(MESSAGES, "u", rollout_id)
        assert result.rollout_id == rollout_id
        assert result.status == RolloutStatus.SUCCESS

    async def test_duplicate_id_409(self, gated):
        """Admitting an id that is still live raises RolloutProtocolError(409)."""
        backend, _server, client = gated
        handle = await client.run_rollout_async(MESSAGES, "u", "dup")
        with pytest.raises(RolloutProtocolError, match="fresh id") as e:
            await client.run_rollout_async(MESSAGES, "u", "dup")
        assert e.value.status_code == 409
        backend.open("dup")
        async with asyncio.timeout(EVENT_SEC):
            assert (await handle).status == RolloutStatus.SUCCESS

    async def test_429_retried_until_admitted(self, gated):
        """A capacity refusal (429 + Retry-After) is waited out and admission succeeds."""
        backend, _server, client = gated
        sleeps: list[float] = []

        async def record(delay: float) -> None:
            sleeps.append(delay)

        override_timing(client, sleep=record)
        backend.full = True
        backend.open("r429")
        async with asyncio.timeout(EVENT_SEC):
            result = await client.run_rollout(MESSAGES, "u", "r429")
        assert result.status == RolloutStatus.SUCCESS
        assert sleeps == [1.0]

    async def test_milestones_and_cancel(self, gated):
        """wait_for_running() sees 'running'; cancel_rollout ends it as 'cancelled'."""
        backend, _server, client = gated
        handle = await client.run_rollout_async(MESSAGES, "u", "c1")
        await backend.wait_started("c1")
        async with asyncio.timeout(EVENT_SEC):
            assert await handle.wait_for_running() == RolloutStatus.RUNNING
            response = await client.cancel_rollout("c1")
            assert response.dispositions == {"c1": CancelDisposition.CANCELLED_RUNNING}
            assert await handle.wait_for_grading() == RolloutStatus.CANCELLED
            result = await handle
        assert result.status == RolloutStatus.CANCELLED
        assert (await client.cancel_rollout("c1")).dispositions == {
            "c1": CancelDisposition.NOT_FOUND
        }

    async def test_local_cancel_leaves_lease_to_expire(self, serve_rollout):
        """handle.cancel() sends nothing; the server expires the lease and cancels the work."""
        backend = GatedBackend()
        server = await serve_rollout(
            backend, result_wait_timeout_sec=0.2, polling_lease_timeout_sec=0.6
        )
        async with RolloutClient(url=server.url) as client:
            handle = await client.run_rollout_async(MESSAGES, "u", "l1")
            await backend.wait_started("l1")
            handle.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handle
            health = await client.wait_idle(timeout_sec=EVENT_SEC, poll_interval_sec=0.1)
        assert health["lifecycle"]["active_rollouts"] == 0
        assert backend.cancelled == {"l1"}

    async def test_version_mismatch_426(self, gated):
        """A client of another protocol major is refused with a version error naming both."""
        _backend, _server, client = gated
        transport = client._channel.transport
        transport._headers = {**transport._headers, PROTOCOL_VERSION_HEADER: "9.0"}
        with pytest.raises(RolloutProtocolVersionError) as e:
            await client.health()
        assert e.value.status_code == 426
        assert "upgrade" in str(e.value)

    async def test_health_and_idle(self, gated):
        """health() reports lifecycle and identity; wait_idle() returns once work is done."""
        backend, _server, client = gated
        handle = await client.run_rollout_async(MESSAGES, "u", "h1")
        await backend.wait_started("h1")
        health = await client.health()
        assert health["lifecycle"] == {"accepting_rollouts": True, "active_rollouts": 1}
        assert isinstance(health["process_id"], str)
        backend.open("h1")
        async with asyncio.timeout(EVENT_SEC):
            idle = await client.wait_idle(
                timeout_sec=EVENT_SEC, poll_interval_sec=0.05, process_id=health["process_id"]
            )
            await handle
        assert idle["lifecycle"]["active_rollouts"] == 0

    async def test_many_concurrent_rollouts(self, gated):
        """One client carries many concurrent rollouts with long polls outstanding."""
        backend, _server, client = gated
        ids = [f"m{i}" for i in range(300)]
        handles = [await client.run_rollout_async(MESSAGES, "u", rid) for rid in ids]
        for rid in ids:
            await backend.wait_started(rid)
        for rid in ids:
            backend.open(rid)
        async with asyncio.timeout(EVENT_SEC * 2):
            results: list[Any] = await asyncio.gather(*handles)
        assert [r.rollout_id for r in results] == ids
        assert {r.status for r in results} == {RolloutStatus.SUCCESS}
        assert all(r.err_category is None for r in results)
