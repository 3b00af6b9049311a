"""Polling leases, lease expiry, publish-once and result retention, over HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

EVENT_SEC = 10.0


class TestLease:
    async def test_polling_keeps_the_lease_alive(self, make_harness: Any) -> None:
        """Polls that keep arriving renew the lease well past its first deadline (1 s)."""
        harness = await make_harness(result_wait_timeout_sec=0.2, polling_lease_timeout_sec=1.0)
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            reply = await harness.poll("r1", token)
            assert reply.json["status"] == "running", reply
        assert not run.cancel_seen.is_set()
        run.succeed()
        assert (await harness.poll_until("r1", token, "success")).json["sample"]["reward"] == 0.5

    async def test_lease_expires_when_polling_stops(self, make_harness: Any) -> None:
        """Without polls for the lease (0.5 s), the result becomes failure / lease_expired and
        the execution is cancelled (backend first, then the server's task)."""
        harness = await make_harness(result_wait_timeout_sec=0.1, polling_lease_timeout_sec=0.5)
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            await run.cancel_seen.wait()
        assert harness.backend.cancel_calls == [["r1"]]
        reply = await harness.poll("r1", token)
        assert reply.json == {
            "rollout_id": "r1",
            "status": "failure",
            "sample": None,
            "err_message": "polling lease expired",
            "err_category": "lease_expired",
        }

    async def test_wrong_token_after_lease_expiry_is_403(self, make_harness: Any) -> None:
        """An expired lease's rollout still authenticates its token: others get 403."""
        harness = await make_harness(result_wait_timeout_sec=0.1, polling_lease_timeout_sec=0.5)
        await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            await run.cancel_seen.wait()
        assert (await harness.poll("r1", "wrong")).status == 403

    async def test_late_outcome_does_not_replace_lease_expired(self, make_harness: Any) -> None:
        """Publication is once: a backend that finishes after the lease expired changes
        nothing on the wire."""
        harness = await make_harness(result_wait_timeout_sec=0.1, polling_lease_timeout_sec=0.5)
        harness.backend.ignore_cancel = True
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            await run.cancel_seen.wait()
        run.succeed(1.0)
        async with asyncio.timeout(EVENT_SEC):
            await run.finished.wait()
        reply = await harness.poll("r1", token)
        assert reply.json["err_category"] == "lease_expired"

    async def test_active_rollouts_counts_until_the_work_stops(self, make_harness: Any) -> None:
        """After lease expiry, lifecycle.active_rollouts stays 1 while the backend still
        works, and drops to 0 once it has stopped."""
        harness = await make_harness(result_wait_timeout_sec=0.1, polling_lease_timeout_sec=0.5)
        harness.backend.ignore_cancel = True
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            await run.cancel_seen.wait()
        assert (await harness.poll("r1", token)).json["err_category"] == "lease_expired"
        assert (await harness.health()).json["lifecycle"]["active_rollouts"] == 1
        run.succeed()
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.registry.idle_future()
        assert (await harness.health()).json["lifecycle"]["active_rollouts"] == 0

    async def test_poll_after_the_deadline_expires_at_once(self, harness: Any) -> None:
        """A poll that arrives after the lease deadline, before the timer has fired, gets
        lease_expired at once and cancellation is requested."""
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        record = harness.server.registry.get("r1")
        record.lease_deadline = asyncio.get_running_loop().time() - 1.0
        reply = await harness.poll("r1", token)
        assert (reply.json["status"], reply.json["err_category"]) == ("failure", "lease_expired")
        async with asyncio.timeout(EVENT_SEC):
            await run.cancel_seen.wait()

    async def test_outcome_after_a_lapsed_lease_is_published_as_lease_expired(
        self, harness: Any
    ) -> None:
        """An execution that finishes after its lease lapsed (timer not fired yet) publishes
        lease_expired instead of its own result."""
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        record = harness.server.registry.get("r1")
        record.lease_deadline = asyncio.get_running_loop().time() - 1.0
        run.succeed()
        async with asyncio.timeout(EVENT_SEC):
            await run.finished.wait()
        await harness.until(lambda: record.published)
        reply = await harness.poll("r1", token)
        assert reply.json["err_category"] == "lease_expired"

    async def test_leases_are_timers_not_tasks(self, harness: Any) -> None:
        """Admitting rollouts adds exactly one task each (its execution): leases and
        retention need no watcher task."""
        await harness.health()  # opens the keep-alive connection (and its handler task)
        before = len(asyncio.all_tasks())
        for index in range(20):
            await harness.admit(f"r{index}")
            await harness.backend.started(f"r{index}")
        assert len(asyncio.all_tasks()) - before == 20
        for index in range(20):
            harness.backend.runs[f"r{index}"].succeed()
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.registry.idle_future()
        assert len(asyncio.all_tasks()) == before


class TestRetention:
    async def test_removed_after_retention_then_admissible_again(self, make_harness: Any) -> None:
        """Once retention (0.2 s) has passed and the work is done, polls get 404 and the same
        id is admitted again with a new token."""
        harness = await make_harness(result_retention_sec=0.2)
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        await harness.poll_until("r1", token, "success")
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.registry.wait_removed("r1")
        assert (await harness.poll("r1", token)).status == 404
        harness.backend.forget("r1")
        new_token = await harness.admit("r1")
        assert new_token != token
        await harness.backend.started("r1")
        assert (await harness.poll("r1", token)).status == 403
        assert (await harness.poll("r1", new_token)).json["status"] == "running"

    async def test_backend_ignoring_cancellation_keeps_the_id_reserved(
        self, make_harness: Any
    ) -> None:
        """After lease expiry, a backend that ignores cancellation keeps its id reserved (409)
        and its result pollable beyond retention, until the work really stops."""
        harness = await make_harness(
            result_wait_timeout_sec=0.1, polling_lease_timeout_sec=0.5, result_retention_sec=0.1
        )
        harness.backend.ignore_cancel = True
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            await run.cancel_seen.wait()
        record = harness.server.registry.get("r1")
        await harness.until(lambda: record.retention_elapsed)
        assert (await harness.post_rollout()).status == 409
        assert (await harness.poll("r1", token)).json["err_category"] == "lease_expired"
        run.succeed()
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.registry.wait_removed("r1")
        assert (await harness.poll("r1", token)).status == 404
        harness.backend.ignore_cancel = False
        assert (await harness.post_rollout()).status == 202

    async def test_zero_retention_frees_the_id_once_the_work_is_done(
        self, make_harness: Any
    ) -> None:
        """With result_retention_sec=0 the record goes as soon as the execution has
        finished: the id answers 404 and can be admitted again."""
        harness = await make_harness(result_retention_sec=0.0)
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.registry.wait_removed("r1")
        assert (await harness.poll("r1", token)).status == 404
        harness.backend.forget("r1")
        assert (await harness.post_rollout()).status == 202

    async def test_retained_result_is_answered_during_retention(self, make_harness: Any) -> None:
        """During retention the final result can be polled again and again."""
        harness = await make_harness(result_retention_sec=60.0)
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        first = await harness.poll_until("r1", token, "success")
        again = await harness.poll("r1", token)
        assert again.raw == first.raw
