"""The pull protocol across implementations: each client drives each server through a rollout.

Directions (every scenario runs in each):

* osmosis-ai 0.3.8's ``RolloutClient`` against our ``rollout-server serve``;
* our ``RolloutClient`` against osmosis-ai 0.3.8's ``create_rollout_server(LocalBackend)``
  under uvicorn;
* this checkout's client against this checkout's server;
* each recorded release of ours (``releases.toml``, the newest of each series in CI) against
  this checkout's other side, in both directions.

The directions are the pairs expected to work in the listing of
:mod:`interop_harness.listing` (the compatibility table). Each side runs in its own venv
(see ``interop_harness.peers``); the client through its driver, the server as a subprocess
on 127.0.0.1. The workflow asks the test's chat stand-in for an answer and the grader
rewards 1.0 when it equals the label, so a test controls when a rollout runs, grades and
finishes, and every outcome is asserted as the client reports it: status, reward,
err_category, error class, status code and message.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from interop_harness import (
    OSMOSIS,
    OURS_SERVER,
    ChatStandIn,
    DriverError,
    Pair,
    ServerProcess,
    python_of,
)
from interop_harness.listing import pair_params
from interop_harness.servers import API_KEY

LLM_KEY = "interop-llm-key"
EVENT_SEC = 30.0
"""Bound on waiting for something a scenario expects (never reached when all is well)."""


@pytest.fixture(scope="module", params=pair_params("works"))
def pair(request: pytest.FixtureRequest) -> Pair:
    """The (client, server) direction under test: every listed pair expected to work."""
    chosen: Pair = request.param[0]
    return chosen


@pytest.fixture(scope="module")
def server(pair: Pair) -> Iterator[ServerProcess]:
    """The direction's server with default settings, shared by the module's tests."""
    process = pair.make_server().start()
    try:
        yield process
    finally:
        process.stop()


def rollout(standin: ChatStandIn, rollout_id: str, **fields: Any) -> dict[str, Any]:
    """The keyword arguments of ``run_rollout`` for a question whose right answer is 4."""
    return {
        "initial_messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "chat_completions_url": standin.url_for(rollout_id),
        "rollout_id": rollout_id,
        "llm_api_key": LLM_KEY,
        "label": "4",
        **fields,
    }


def new_id() -> str:
    """A fresh rollout id made of characters every peer handles (uuid4 hex)."""
    return uuid.uuid4().hex


def assert_protocol_error(error: DriverError, status: int, prefix: str) -> None:
    """The client raised its ``RolloutProtocolError`` for HTTP ``status``, worded ``prefix``."""
    assert "RolloutProtocolError" in error.mro, error
    assert error.status_code == status, error
    assert error.message.startswith(prefix), error


def assert_graded_success(result: dict[str, Any], rollout_id: str, reward: float) -> None:
    """A success whose sample carries the stand-in's answer and ``reward``."""
    assert result["rollout_id"] == rollout_id
    assert result["status"] == "success"
    assert result["err_category"] is None
    assert result["err_message"] is None
    assert result["sample"]["reward"] == reward
    assert result["sample"]["label"] == "4"
    assert result["sample"]["messages"][-1]["role"] == "assistant"


class TestRollouts:
    """Runs to completion, with grading, failures and milestones."""

    async def test_run_to_completion_with_grading(
        self, pair: Pair, server: ServerProcess, standin: ChatStandIn, open_client: Any
    ) -> None:
        """A right answer is a success with reward 1.0, and the LLM key reached the agent."""
        client = await open_client(pair, server.url)
        rid = new_id()
        result = await client.call("run_rollout", **rollout(standin, rid))
        assert_graded_success(result, rid, 1.0)
        assert result["sample"]["messages"][-1]["content"] == "4"
        assert [r["auth"] for r in standin.requests] == [f"Bearer {LLM_KEY}"]

    async def test_wrong_answer_scores_zero(
        self, pair: Pair, server: ServerProcess, standin: ChatStandIn, open_client: Any
    ) -> None:
        """A wrong answer is still a success, with the grader's reward 0.0."""
        client = await open_client(pair, server.url)
        rid = new_id()
        standin.answer(rid, "5")
        result = await client.call("run_rollout", **rollout(standin, rid))
        assert_graded_success(result, rid, 0.0)

    @pytest.mark.parametrize(
        ("fail", "category", "message"),
        [("value", "validation_error", "interop: bad value"), ("runtime", "agent_error", "boom")],
    )
    async def test_workflow_errors_are_classified(
        self,
        pair: Pair,
        server: ServerProcess,
        standin: ChatStandIn,
        open_client: Any,
        fail: str,
        category: str,
        message: str,
    ) -> None:
        """A workflow exception arrives as failure with its category and message and no reward."""
        client = await open_client(pair, server.url)
        rid = new_id()
        result = await client.call("run_rollout", **rollout(standin, rid, metadata={"fail": fail}))
        assert result["status"] == "failure"
        assert result["err_category"] == category
        assert message in result["err_message"]
        assert result["sample"] is None or result["sample"]["reward"] is None

    async def test_handle_milestones(
        self, pair: Pair, server: ServerProcess, standin: ChatStandIn, open_client: Any
    ) -> None:
        """A handle reports running while the agent runs, grading while graded, then the result."""
        client = await open_client(pair, server.url)
        rid = new_id()
        standin.hold("chat", rid)
        standin.hold("gate", rid)
        admitted = await client.call(
            "start", **rollout(standin, rid, metadata={"grade_gate_url": standin.gate_url(rid)})
        )
        assert admitted == {"rollout_id": rid, "status": "queued"}
        await standin.arrived("chat", rid, timeout_sec=EVENT_SEC)
        assert await client.call("wait_for_running", rollout_id=rid) == "running"
        standin.release("chat", rid)
        await standin.arrived("gate", rid, timeout_sec=EVENT_SEC)
        assert await client.call("wait_for_grading", rollout_id=rid) == "grading"
        state = await client.call("state", rollout_id=rid)
        assert state["done"] is False
        assert state["latest_result"]["status"] == "grading"
        assert state["latest_result"]["sample"] is None
        standin.release("gate", rid)
        assert_graded_success(await client.call("result", rollout_id=rid), rid, 1.0)
        assert (await client.call("state", rollout_id=rid))["done"] is True

    async def test_our_server_shows_each_milestone_within_the_grace(
        self, pair: Pair, own_server: list[ServerProcess], standin: ChatStandIn, open_client: Any
    ) -> None:
        """With a 60 s wait (past the bound), our server answers running while the agent is
        held and grading while the grader is held, each within its 1 s grace, and the
        client's handle reports both: one result request per phase."""
        checkout_server = python_of(OURS_SERVER)
        if pair.server != OURS_SERVER or pair.server_python not in (None, checkout_server):
            pytest.skip(
                "only this checkout's server answers a change made between polls within the "
                "grace; osmosis-ai and our releases answer it at the next change or after "
                "the whole wait (spec 4.6)"
            )
        process = pair.make_server(wait_sec=60.0).start()
        own_server.append(process)
        client = await open_client(pair, process.url)
        rid = new_id()
        standin.hold("chat", rid)
        standin.hold("gate", rid)
        await client.call(
            "start", **rollout(standin, rid, metadata={"grade_gate_url": standin.gate_url(rid)})
        )
        await standin.arrived("chat", rid, timeout_sec=EVENT_SEC)
        running = await client.call("wait_for_running", rollout_id=rid, timeout_sec=EVENT_SEC)
        assert running == "running"
        standin.release("chat", rid)
        await standin.arrived("gate", rid, timeout_sec=EVENT_SEC)
        grading = await client.call("wait_for_grading", rollout_id=rid, timeout_sec=EVENT_SEC)
        assert grading == "grading"
        standin.release("gate", rid)
        result = await client.call("result", rollout_id=rid, timeout_sec=EVENT_SEC)
        assert_graded_success(result, rid, 1.0)
        assert client.responses("GET", f"/rollout/{rid}/result") == [200, 200, 200]

    async def test_cancel_and_wait(
        self, pair: Pair, server: ServerProcess, standin: ChatStandIn, open_client: Any
    ) -> None:
        """Cancelling a running rollout reports cancelled_running and the handle ends cancelled."""
        client = await open_client(pair, server.url)
        rid = new_id()
        standin.hold("chat", rid)
        await client.call("start", **rollout(standin, rid))
        await standin.arrived("chat", rid, timeout_sec=EVENT_SEC)
        cancelled = await client.call("cancel_rollout", rollout_id=rid)
        assert cancelled == {"dispositions": {rid: "cancelled_running"}}
        result = await client.call("result", rollout_id=rid)
        assert result["status"] == "cancelled"
        assert result["err_category"] is None
        assert result["err_message"] == "cancelled"
        assert result["sample"] is None
        again = await client.call("cancel_rollout", rollout_id=rid)
        assert again == {"dispositions": {rid: "not_found"}}

    async def test_duplicate_id_is_refused_with_409(
        self, pair: Pair, server: ServerProcess, standin: ChatStandIn, open_client: Any
    ) -> None:
        """Admitting a live rollout's id again raises the client's protocol error for 409."""
        client = await open_client(pair, server.url)
        rid = new_id()
        standin.hold("chat", rid)
        await client.call("start", **rollout(standin, rid))
        with pytest.raises(DriverError) as caught:
            await client.call("start", **rollout(standin, rid))
        assert_protocol_error(
            caught.value, 409, "POST /rollout returned 409; only 202 and 429 are accepted"
        )
        standin.release("chat", rid)
        assert_graded_success(await client.call("result", rollout_id=rid), rid, 1.0)


class TestHealth:
    """health(), wait_idle() pinned to a process id, and restarts."""

    async def test_health_reports_identity_and_lifecycle(
        self, pair: Pair, server: ServerProcess, open_client: Any
    ) -> None:
        """health() returns identity, an idle lifecycle and (ours only) the protocol version."""
        client = await open_client(pair, server.url)
        health = await client.call("health")
        assert isinstance(health["process_id"], str)
        assert str(uuid.UUID(health["process_id"])) == health["process_id"]
        assert health["instance_id"] == health["process_id"]
        assert health["lifecycle"] == {"accepting_rollouts": True, "active_rollouts": 0}
        advertised = {e.get("protocol") for e in client.events if e.get("kind") == "response"}
        if pair.server == OURS_SERVER:
            assert re.fullmatch(r"\d+\.\d+", health["protocol_version"])
            assert advertised == {health["protocol_version"]}
        else:
            assert "protocol_version" not in health
            assert advertised == {None}

    async def test_wait_idle_pinned_to_process_id(
        self, pair: Pair, server: ServerProcess, standin: ChatStandIn, open_client: Any
    ) -> None:
        """wait_idle() returns once the running rollout ended, and rejects a foreign process id."""
        client = await open_client(pair, server.url)
        process_id = (await client.call("health"))["process_id"]
        rid = new_id()
        standin.hold("chat", rid)
        await client.call("start", **rollout(standin, rid))
        await standin.arrived("chat", rid, timeout_sec=EVENT_SEC)
        busy = await client.call("health")
        assert busy["lifecycle"]["active_rollouts"] >= 1
        idle = asyncio.create_task(
            client.call(
                "wait_idle", process_id=process_id, timeout_sec=EVENT_SEC, poll_interval_sec=0.1
            )
        )
        standin.release("chat", rid)
        health = await idle
        assert health["process_id"] == process_id
        assert health["lifecycle"]["active_rollouts"] == 0
        with pytest.raises(DriverError) as caught:
            await client.call("wait_idle", process_id=str(uuid.uuid4()), timeout_sec=EVENT_SEC)
        assert_protocol_error(caught.value, 200, "Server restarted while waiting")

    async def test_restart_is_detected_through_process_id(
        self, pair: Pair, own_server: list[ServerProcess], open_client: Any
    ) -> None:
        """After a restart on the same port, wait_idle() pinned to the old process id fails."""
        process = pair.make_server().start()
        own_server.append(process)
        client = await open_client(pair, process.url)
        before = (await client.call("health"))["process_id"]
        process.restart()
        with pytest.raises(DriverError) as caught:
            await client.call(
                "wait_idle", process_id=before, timeout_sec=EVENT_SEC, poll_interval_sec=0.1
            )
        assert_protocol_error(caught.value, 200, "Server restarted while waiting")
        after = (await client.call("health"))["process_id"]
        assert after != before
        assert (await client.call("wait_idle", process_id=after, timeout_sec=EVENT_SEC))[
            "process_id"
        ] == after


class TestLeaseAndBackpressure:
    """Lease expiry once the client stops polling, and 429 with Retry-After."""

    async def test_lease_expires_after_client_stops_polling(
        self,
        pair: Pair,
        own_server: list[ServerProcess],
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """A rollout nobody polls fails as lease_expired and its work is cancelled."""
        process = pair.make_server(lease_sec=3.0).start()
        own_server.append(process)
        client = await open_client(pair, process.url)
        rid = new_id()
        standin.hold("chat", rid)
        await client.call("start", **rollout(standin, rid))
        await standin.arrived("chat", rid, timeout_sec=EVENT_SEC)
        assert await client.call("stop_polling", rollout_id=rid) is True
        # Idle means the held workflow ended: only the lease watcher's cancellation ends it.
        idle = await client.call("wait_idle", timeout_sec=EVENT_SEC, poll_interval_sec=0.2)
        assert idle["lifecycle"]["active_rollouts"] == 0
        if pair.client == OSMOSIS:
            seen = await client.call("peek", rollout_id=rid)
            assert seen["http_status"] == 200
            assert seen["body"]["status"] == "failure"
            assert seen["body"]["err_category"] == "lease_expired"
            assert seen["body"]["err_message"] == "polling lease expired"
        with pytest.raises(DriverError) as caught:
            await client.call("start", **rollout(standin, rid))
        assert_protocol_error(
            caught.value, 409, "POST /rollout returned 409; only 202 and 429 are accepted"
        )

    async def test_backpressure_429_then_retry(
        self,
        pair: Pair,
        own_server: list[ServerProcess],
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """With the only slot taken admission gets 429 + Retry-After and succeeds once it frees."""
        if pair.server == OURS_SERVER:
            process = pair.make_server(target="ours_app:backpressure_backend")
        else:
            process = pair.make_server(backpressure=True)
        own_server.append(process.start())
        client = await open_client(pair, process.url)
        first, second = new_id(), new_id()
        standin.hold("chat", first)
        await client.call("start", **rollout(standin, first))
        await standin.arrived("chat", first, timeout_sec=EVENT_SEC)
        admitting = asyncio.create_task(
            client.call("start", timeout_sec=90.0, **rollout(standin, second))
        )
        refused = await client.wait_event(
            lambda e: e.get("kind") == "response" and e.get("status") == 429,
            timeout_sec=EVENT_SEC,
        )
        assert 1 <= float(refused["retry_after"]) <= 60
        assert not admitting.done()
        standin.release("chat", first)
        assert_graded_success(await client.call("result", rollout_id=first), first, 1.0)
        assert (await admitting)["rollout_id"] == second
        assert_graded_success(await client.call("result", rollout_id=second), second, 1.0)
        statuses = client.responses("POST", "/rollout")
        assert statuses[0] == 202
        assert statuses[-1] == 202
        assert set(statuses[1:-1]) == {429}


class TestBearerAuth:
    """The optional bearer key, on and off."""

    async def test_auth_on(
        self,
        pair: Pair,
        own_server: list[ServerProcess],
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """With a key the client works; without or with a wrong key every route answers 401."""
        process = pair.make_server(api_key=True).start()
        own_server.append(process)
        keyed = await open_client(pair, process.url, api_key=API_KEY)
        rid = new_id()
        assert_graded_success(await keyed.call("run_rollout", **rollout(standin, rid)), rid, 1.0)
        assert (await keyed.call("health"))["lifecycle"]["active_rollouts"] == 0
        for key in (None, "wrong-key"):
            other = await open_client(pair, process.url, api_key=key)
            with pytest.raises(DriverError) as caught:
                await other.call("health")
            assert_protocol_error(caught.value, 401, "GET /health failed")
            with pytest.raises(DriverError) as caught:
                await other.call("run_rollout", **rollout(standin, new_id()))
            assert_protocol_error(
                caught.value, 401, "POST /rollout returned 401; only 202 and 429 are accepted"
            )
            with pytest.raises(DriverError) as caught:
                await other.call("cancel_rollout", rollout_id=rid)
            assert_protocol_error(caught.value, 401, "POST /rollout/cancel returned")

    async def test_auth_off_accepts_a_keyed_client(
        self, pair: Pair, server: ServerProcess, standin: ChatStandIn, open_client: Any
    ) -> None:
        """A server without a key serves a client that sends one."""
        client = await open_client(pair, server.url, api_key=API_KEY)
        rid = new_id()
        assert_graded_success(await client.call("run_rollout", **rollout(standin, rid)), rid, 1.0)
