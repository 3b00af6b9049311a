"""The shared scenario suite of the compatibility matrix, run for every pair of the table.

A ``works`` pair must run a graded rollout, cancel one, report health and wait until
idle, and refuse a duplicate id, with the client's observable results. A ``fails-fast``
pair passes only if the client's first admission fails within ``FAIL_FAST_SEC`` with the
expected error class (or a subclass) and a message, or refused body, that says to upgrade.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from interop_harness import ChatStandIn, DriverError, Pair, ServerProcess

FAIL_FAST_SEC = 10.0
"""Bound on the expected failure of a fails-fast pair (driver reports DriverTimeout past it)."""
EVENT_SEC = 30.0
"""Bound on waiting for something a scenario expects (never reached when all is well)."""


@pytest.fixture(scope="module")
def works_pair(request: pytest.FixtureRequest) -> tuple[Pair, dict[str, Any]]:
    """A pair expected to work, with its table entry."""
    chosen: tuple[Pair, dict[str, Any]] = request.param
    return chosen


@pytest.fixture(scope="module")
def failing_pair(request: pytest.FixtureRequest) -> tuple[Pair, dict[str, Any]]:
    """A pair expected to fail fast, with its table entry."""
    chosen: tuple[Pair, dict[str, Any]] = request.param
    return chosen


@pytest.fixture(scope="module")
def works_server(works_pair: tuple[Pair, dict[str, Any]]) -> Iterator[ServerProcess]:
    """The server side of the pair, started once for the module's scenarios."""
    process = works_pair[0].make_server().start()
    try:
        yield process
    finally:
        process.stop()


def rollout(standin: ChatStandIn, rollout_id: str, **fields: Any) -> dict[str, Any]:
    """Keyword arguments of ``run_rollout`` for a question whose right answer is 4."""
    return {
        "initial_messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "chat_completions_url": standin.url_for(rollout_id),
        "rollout_id": rollout_id,
        "label": "4",
        **fields,
    }


class TestWorkingPairs:
    """Scenarios every working pair passes."""

    async def test_graded_rollout(
        self,
        works_pair: tuple[Pair, dict[str, Any]],
        works_server: ServerProcess,
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """A right answer is a success with reward 1.0; a wrong one a success with 0.0."""
        client = await open_client(works_pair[0], works_server.url)
        right, wrong = uuid.uuid4().hex, uuid.uuid4().hex
        standin.answer(wrong, "5")
        for rid, reward in ((right, 1.0), (wrong, 0.0)):
            result = await client.call("run_rollout", **rollout(standin, rid))
            assert result["rollout_id"] == rid
            assert result["status"] == "success"
            assert result["err_category"] is None
            assert result["sample"]["reward"] == reward

    async def test_cancel_running_rollout(
        self,
        works_pair: tuple[Pair, dict[str, Any]],
        works_server: ServerProcess,
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """A cancelled running rollout reports cancelled_running and ends cancelled."""
        client = await open_client(works_pair[0], works_server.url)
        rid = uuid.uuid4().hex
        standin.hold("chat", rid)
        await client.call("start", **rollout(standin, rid))
        await standin.arrived("chat", rid, timeout_sec=EVENT_SEC)
        assert await client.call("cancel_rollout", rollout_id=rid) == {
            "dispositions": {rid: "cancelled_running"}
        }
        result = await client.call("result", rollout_id=rid)
        assert result["status"] == "cancelled"
        assert result["sample"] is None

    async def test_health_and_wait_idle(
        self,
        works_pair: tuple[Pair, dict[str, Any]],
        works_server: ServerProcess,
        open_client: Any,
    ) -> None:
        """health() names the process and wait_idle() pinned to it returns it idle."""
        client = await open_client(works_pair[0], works_server.url)
        health = await client.call("health")
        process_id = health["process_id"]
        assert str(uuid.UUID(process_id)) == process_id
        idle = await client.call(
            "wait_idle", process_id=process_id, timeout_sec=EVENT_SEC, poll_interval_sec=0.1
        )
        assert idle["process_id"] == process_id
        assert idle["lifecycle"]["active_rollouts"] == 0

    async def test_duplicate_is_refused(
        self,
        works_pair: tuple[Pair, dict[str, Any]],
        works_server: ServerProcess,
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """A second admission of a live id raises the client's protocol error for 409."""
        client = await open_client(works_pair[0], works_server.url)
        rid = uuid.uuid4().hex
        standin.hold("chat", rid)
        await client.call("start", **rollout(standin, rid))
        with pytest.raises(DriverError) as caught:
            await client.call("start", **rollout(standin, rid))
        assert "RolloutProtocolError" in caught.value.mro
        assert caught.value.status_code == 409
        standin.release("chat", rid)
        assert (await client.call("result", rollout_id=rid))["status"] == "success"


class TestFailingPairs:
    """Pairs that must fail fast, at the first admission, with a clear error."""

    async def test_first_admission_fails_fast(
        self,
        failing_pair: tuple[Pair, dict[str, Any]],
        own_server: list[ServerProcess],
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """The expected error arrives within FAIL_FAST_SEC, says to upgrade, and nothing ran."""
        pair, entry = failing_pair
        process = pair.make_server().start()
        own_server.append(process)
        client = await open_client(pair, process.url)
        rid = uuid.uuid4().hex
        with pytest.raises(DriverError) as caught:
            await client.call("run_rollout", timeout_sec=FAIL_FAST_SEC, **rollout(standin, rid))
        error = caught.value
        assert entry["error"] in error.mro, error
        assert error.status_code is not None
        assert 400 <= error.status_code < 500, error
        explanation = f"{error.message} {error.error.get('response_body') or ''}"
        assert "upgrade" in explanation, error
        assert standin.requests == []
