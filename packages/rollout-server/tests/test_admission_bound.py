"""The bound on admitted work holds exactly under truly concurrent admissions, through real
HTTP: LocalBackend's ``max_concurrent + max_queued`` (reservations), and a backend that
only answers ``has_capacity()`` from the work it has started (the server's own count); and
the backend's ``admission_mode`` decides which of the two the server does."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionRequest,
    LocalBackend,
    WorkflowContext,
    create_rollout_server,
)
from rollout_types import CancelRolloutsRequest, RolloutInitRequest, structure_wire

EVENT_SEC = 10.0
SUBMITTERS = 64


class BlockedWorkflow(AgentWorkflow):
    """Runs until cancelled."""

    async def run(self, ctx: WorkflowContext) -> None:
        await asyncio.get_running_loop().create_future()


class StartedCountingBackend(ExecutionBackend):
    """An osmosis-style backend: has_capacity() counts only executions that have started."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.started = 0

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        self.started += 1
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")

    def has_capacity(self) -> bool:
        return self.started < self.bound


class AskedBackend(ExecutionBackend):
    """Records how many executions had started when each admission asked for room
    (default admission_mode: "started_work")."""

    def __init__(self) -> None:
        self.started = 0
        self.asked_at: list[int] = []

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        self.started += 1
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")

    def try_reserve(self) -> bool:
        self.asked_at.append(self.started)
        return True


class ReservingBackend(AskedBackend):
    """Counts its reservations itself."""

    admission_mode = "reservations"


def bounded_local(tmp_path: Path, *, slots: int, queued: int) -> LocalBackend:
    """A LocalBackend of blocked workflows with ``slots`` slots and ``max_queued=queued``."""
    return LocalBackend(
        BlockedWorkflow,
        workflow_config=AgentWorkflowConfig(name="t", concurrency={"max_concurrent": slots}),
        max_queued=queued,
        artifact_root=tmp_path,
    )


async def burst(harness: Any, count: int) -> Counter[int]:
    """Open ``count`` connections, then send ``count`` admissions on them at once; return
    how many got each status."""
    url = str(harness.client.make_url("/"))
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(url, connector=connector) as session:

        async def health() -> None:
            async with session.get("/health") as response:
                assert response.status == 200
                await response.read()

        async def admit(index: int) -> int:
            body = {"initial_messages": [], "rollout_id": f"b{index}", "chat_completions_url": ""}
            async with session.post("/rollout", json=body) as response:
                await response.read()
                return response.status

        async with asyncio.timeout(EVENT_SEC):
            await asyncio.gather(*(health() for _ in range(count)))  # warm connections
            statuses = await asyncio.gather(*(admit(index) for index in range(count)))
    return Counter(statuses)


class TestAdmissionBound:
    async def test_local_backend_admits_exactly_slots_plus_queue(
        self, make_harness: Any, tmp_path: Path
    ) -> None:
        """With max_concurrent=2 and max_queued=4, 64 concurrent submitters get exactly 6
        x 202 and 58 x 429, and the queue never holds more than 4."""
        backend = bounded_local(tmp_path, slots=2, queued=4)
        harness = await make_harness(backend)
        statuses = await burst(harness, SUBMITTERS)
        assert statuses == {202: 6, 429: SUBMITTERS - 6}
        await harness.until(lambda: backend.health()["concurrency"]["running"] == 2)
        concurrency = backend.health()["concurrency"]
        assert (concurrency["running"], concurrency["queued"]) == (2, 4)
        assert not backend.try_reserve()

    async def test_a_has_capacity_only_backend_is_bounded_by_the_servers_count(
        self, make_harness: Any
    ) -> None:
        """A backend whose has_capacity() counts only started executions (bound 3) gets
        exactly 3 admissions out of 64 concurrent ones."""
        backend = StartedCountingBackend(bound=3)
        harness = await make_harness(backend)
        statuses = await burst(harness, SUBMITTERS)
        assert statuses == {202: 3, 429: SUBMITTERS - 3}
        await harness.until(lambda: backend.started == 3)
        assert harness.server.registry.active == 3

    async def test_a_rollout_cancelled_before_it_starts_frees_its_reservation(
        self, make_harness: Any, tmp_path: Path
    ) -> None:
        """A rollout cancelled in the turn of its admission never starts, and its
        reservation ends all the same: the one slot is free again."""
        backend = bounded_local(tmp_path, slots=1, queued=0)
        harness = await make_harness(backend)
        init = structure_wire(
            {"initial_messages": [], "rollout_id": "r1", "chat_completions_url": ""},
            RolloutInitRequest,
        )
        token = await harness.server.admit(init)  # nothing awaited before the cancel
        assert not backend.try_reserve()
        await harness.server.cancel(CancelRolloutsRequest(ids=["r1"]))
        assert isinstance(token, str)
        await harness.poll_until("r1", token, "cancelled")
        assert backend.try_reserve()
        backend.release_reservation()

    @pytest.mark.parametrize("refusal", ["shutting_down", "duplicate"])
    async def test_refused_admissions_hold_no_reservation(
        self, make_harness: Any, tmp_path: Path, body: Any, refusal: str
    ) -> None:
        """An admission refused after the reservation (a duplicate id) or before it (the
        server is shutting down) leaves the backend's count as it was."""
        backend = bounded_local(tmp_path, slots=1, queued=1)
        harness = await make_harness(backend)
        await harness.admit("r1")
        if refusal == "duplicate":
            assert (await harness.post_rollout(body("r1"))).status == 409
        else:
            harness.server.begin_shutdown()
            assert (await harness.post_rollout(body("r2"))).status == 503
        assert backend.try_reserve()  # one queue place is still free
        backend.release_reservation()


class TestAdmissionMode:
    @pytest.mark.parametrize(
        ("backend_class", "asked_at"), [(AskedBackend, [0, 1]), (ReservingBackend, [0, 0])]
    )
    async def test_the_mode_says_whether_an_admission_waits_for_earlier_starts(
        self, make_harness: Any, backend_class: type[AskedBackend], asked_at: list[int]
    ) -> None:
        """Two admissions at once: a "started_work" backend is asked for the second only
        once the first has started; a "reservations" backend is asked for both at once."""
        backend = backend_class()
        harness = await make_harness(backend)
        inits = [
            structure_wire(
                {"initial_messages": [], "rollout_id": rid, "chat_completions_url": ""},
                RolloutInitRequest,
            )
            for rid in ("r1", "r2")
        ]
        async with asyncio.timeout(EVENT_SEC):
            tokens = await asyncio.gather(*(harness.server.admit(init) for init in inits))
        assert all(isinstance(token, str) for token in tokens)
        assert backend.asked_at == asked_at
        assert ExecutionBackend.admission_mode == "started_work"
        assert LocalBackend.admission_mode == "reservations"

    def test_an_unknown_mode_is_refused_when_the_server_is_built(self) -> None:
        """A backend whose admission_mode is neither value fails at once, naming it."""

        class Sometimes(AskedBackend):
            admission_mode = "sometimes"  # type: ignore[assignment]  # the wrong use tested

        with pytest.raises(
            ValueError,
            match=re.escape(
                "Sometimes.admission_mode must be 'reservations' or 'started_work'; got 'sometimes'"
            ),
        ):
            create_rollout_server(backend=Sometimes())
