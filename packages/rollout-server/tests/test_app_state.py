"""``create_rollout_server(state="sqlite:///...")`` in process: what is stored and when (an
admission before its 202, a result before any poll sees it, never the token), what a store
that fails does (503 on admission, a result served from memory), and a restart from the file
a crash leaves (a consistent copy of what was committed)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rollout_server import (
    ExecutionOutcome,
    ExecutionResult,
    Sample,
    ShutdownTimeouts,
    create_rollout_server,
)
from rollout_server.execution._reattach import Reattached
from rollout_server.state._sqlite import SqliteStore
from rollout_server.state._store import StateOpenError, StoreWriteError
from rollout_types import RolloutStatus

Harness = Any
"""conftest's ``Harness`` (test files cannot import conftest)."""
MakeHarness = Any

EVENT_SEC = 10.0

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def url(path: Path) -> str:
    return f"sqlite://{path}"


def rows(path: Path) -> dict[str, dict[str, Any]]:
    """The committed rows of a state file, read by a connection of the test's own."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.row_factory = sqlite3.Row
        return {row["rollout_id"]: dict(row) for row in db.execute("SELECT * FROM rollouts")}


def crash_copy(path: Path, to: Path) -> None:
    """What a crash leaves: every committed transaction, nothing else (sqlite's backup)."""
    with (
        contextlib.closing(sqlite3.connect(path)) as source,
        contextlib.closing(sqlite3.connect(to)) as target,
    ):
        source.backup(target)


def file_bytes(path: Path) -> bytes:
    return b"".join(
        candidate.read_bytes()
        for candidate in (path, path.with_name(path.name + "-wal"))
        if candidate.exists()
    )


def store_of(harness: Harness) -> SqliteStore:
    store = harness.server._store
    assert isinstance(store, SqliteStore)
    return store


async def stored_writes(harness: Harness, count: int) -> None:
    """Wait (bounded) until the store has committed ``count`` writes."""
    store = store_of(harness)
    async with asyncio.timeout(EVENT_SEC):
        while store.stats.writes < count:  # noqa: ASYNC110 - a counter of the writer thread
            await asyncio.sleep(0.01)


class TestStored:
    async def test_an_admission_is_stored_before_its_202_and_never_its_token(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        path = tmp_path / "state.db"
        harness = await make_harness(state=url(path))
        token = await harness.admit("r1")
        row = rows(path)["r1"]
        assert row["status"] == "queued"
        assert row["result"] is None
        assert row["token_sha256"] == hashlib.sha256(token.encode()).digest()
        assert row["process_id"] == harness.server.process_id
        assert row["lease_sec"] == 5.0
        assert token.encode() not in file_bytes(path)

    async def test_a_result_is_visible_only_once_stored(
        self, make_harness: MakeHarness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """While the result's write is held, polls still answer the running status; once
        it is durable they answer the result, and the file holds those exact bytes."""
        path = tmp_path / "state.db"
        harness = await make_harness(state=url(path))
        store = store_of(harness)
        token = await harness.admit("r1")
        held: list[asyncio.Future[None]] = []
        real_publish = store.publish

        def held_publish(row: Any) -> asyncio.Future[None]:
            gate = asyncio.get_running_loop().create_future()
            written = real_publish(row)

            def release(_gate: Any) -> None:
                written.add_done_callback(lambda _w: outer.set_result(None))

            outer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            gate.add_done_callback(release)
            held.append(gate)
            return outer

        monkeypatch.setattr(store, "publish", held_publish)
        run = await harness.backend.started("r1")
        run.succeed(reward=0.25)
        await harness.until(lambda: bool(held))
        reply = await harness.poll("r1", token)
        assert reply.json["status"] == "running"
        held[0].set_result(None)
        reply = await harness.poll_until("r1", token, "success")
        assert rows(path)["r1"]["result"] == reply.raw

    async def test_lease_renewals_write_nothing(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        harness = await make_harness(state=url(tmp_path / "state.db"), result_wait_timeout_sec=0.05)
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        await stored_writes(harness, 1)
        for _ in range(5):
            assert (await harness.poll("r1", token)).status == 200
        assert store_of(harness).stats.writes == 1

    async def test_a_cancel_disposition_is_stored(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        path = tmp_path / "state.db"
        harness = await make_harness(state=url(path))
        harness.backend.ignore_cancel = True
        await harness.admit("r1")
        await harness.backend.started("r1")
        reply = await harness.cancel({"ids": ["r1"]})
        assert reply.json["dispositions"] == {"r1": "cancelled_running"}
        await store_of(harness).flush()
        assert rows(path)["r1"]["cancel_disposition"] == "cancelled_running"

    async def test_a_removed_rollout_is_deleted_from_the_file(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        path = tmp_path / "state.db"
        harness = await make_harness(state=url(path), result_retention_sec=0.1)
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        await harness.poll_until("r1", token, "success")
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.registry.wait_removed("r1")
        await store_of(harness).flush()
        assert rows(path) == {}

    async def test_health_reports_the_store_and_its_commits(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        harness = await make_harness(state=url(tmp_path / "state.db"))
        await asyncio.gather(*(harness.admit(f"r{i}") for i in range(20)))
        state = (await harness.health()).json["state"]
        assert state["store"] == "sqlite"
        assert state["writes"] == 20
        assert 1 <= state["commits"] <= 20
        assert state["largest_commit"] >= 1
        assert state["failed_commits"] == 0


class TestStoreFailures:
    async def test_an_admission_the_store_cannot_keep_gets_503_and_is_not_held(
        self, make_harness: MakeHarness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        harness = await make_harness(state=url(tmp_path / "state.db"))
        store = store_of(harness)
        real_admit = store.admit

        def failing_admit(row: Any) -> asyncio.Future[None]:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(
                StoreWriteError("writing ... failed", reason="database or disk is full")
            )
            return fut

        monkeypatch.setattr(store, "admit", failing_admit)
        reply = await harness.post_rollout()
        assert reply.status == 503
        assert reply.headers["Retry-After"] == "5"
        assert reply.json == {
            "detail": "the rollout was not admitted: the server could not store it (database "
            "or disk is full); retry later (the operator must free disk space or fix the "
            "state file)"
        }
        assert str(tmp_path) not in reply.raw.decode()
        assert "r1" not in harness.server.registry
        monkeypatch.setattr(store, "admit", real_admit)
        await harness.admit("r1")

    async def test_a_result_the_store_cannot_keep_is_served_from_memory_and_logged(
        self,
        make_harness: MakeHarness,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        harness = await make_harness(state=url(tmp_path / "state.db"))
        store = store_of(harness)

        def failing_publish(row: Any) -> asyncio.Future[None]:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(StoreWriteError("writing failed: disk full", reason="disk full"))
            return fut

        monkeypatch.setattr(store, "publish", failing_publish)
        token = await harness.admit("r1")
        with caplog.at_level(logging.ERROR, logger="rollout_server.registry"):
            (await harness.backend.started("r1")).succeed(reward=0.75)
            reply = await harness.poll_until("r1", token, "success")
        assert reply.json["sample"]["reward"] == 0.75
        assert (
            "The result of rollout r1 could not be stored (writing failed: disk full); it is "
            "served from this process's memory only, and a restart would lose it"
        ) in caplog.text

    async def test_a_full_disk_refuses_admission_with_503_not_500(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        if not IS_ROOT:
            pytest.skip("mounting a tmpfs needs root")
        with small_tmpfs(tmp_path / "small") as mount:
            harness = await make_harness(state=url(mount / "state.db"))
            await harness.admit("before")
            fill(mount / "filler")
            replies = [await harness.post_rollout(body_for(f"r{i}")) for i in range(50)]
            statuses = {reply.status for reply in replies}
            assert 503 in statuses
            assert 500 not in statuses
            refused = next(reply for reply in replies if reply.status == 503)
            assert "could not store it" in refused.json["detail"]
            (mount / "filler").unlink()
            await harness.admit("after")


def body_for(rollout_id: str) -> dict[str, Any]:
    """A ``POST /rollout`` body (as conftest's ``init_body`` makes it)."""
    return {
        "initial_messages": [{"role": "user", "content": "hello"}],
        "rollout_id": rollout_id,
        "chat_completions_url": "http://127.0.0.1:9/v1",
    }


def fill(path: Path) -> None:
    """Write ``path`` until the file system is full."""
    with path.open("wb", buffering=0) as file, contextlib.suppress(OSError):
        while True:
            file.write(b"\0" * 4096)


@contextlib.contextmanager
def small_tmpfs(where: Path) -> Iterator[Path]:
    where.mkdir(parents=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


class TestRestart:
    async def test_a_restart_from_what_a_crash_leaves(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        """The file a crash leaves, opened by a new server: results within retention for the
        original tokens (403 for another), in-flight rollouts failed naming the old process,
        recovered ids 409, the counts in /health."""
        path, copy = tmp_path / "state.db", tmp_path / "after-crash.db"
        first = await make_harness(state=url(path))
        done = await first.admit("done")
        flying = await first.admit("flying")
        cancelled = await first.admit("cancelled")
        (await first.backend.started("done")).succeed(reward=0.5)
        await first.backend.started("flying")
        await first.backend.started("cancelled")
        await first.cancel({"ids": ["cancelled"]})
        # 3 admissions, 2 results, 1 disposition.
        await stored_writes(first, 6)
        crash_copy(path, copy)
        old_process = first.server.process_id

        second = await make_harness(state=url(copy))
        reply = await second.poll("done", done)
        assert reply.status == 200
        assert reply.json["status"] == "success"
        assert reply.json["sample"]["reward"] == 0.5
        assert (await second.poll("done", flying)).status == 403
        reply = await second.poll("flying", flying)
        assert reply.json == {
            "rollout_id": "flying",
            "status": "failure",
            "sample": None,
            "err_message": f"the server process {old_process} ended before the rollout finished",
            "err_category": "internal_error",
        }
        assert (await second.poll("cancelled", cancelled)).json["status"] == "cancelled"
        for rollout_id in ("done", "flying", "cancelled"):
            assert (await second.post_rollout(body_for(rollout_id))).status == 409
        state = (await second.health()).json["state"]
        assert state["recovered_rollouts"] == 2
        assert state["failed_by_restart"] == 1
        # The restart failure is stored too: a second restart answers it unchanged.
        assert rows(copy)["flying"]["status"] == "failure"

    async def test_a_backend_that_outlived_the_process_takes_its_rollouts_back(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        """A backend with the re-attach hooks is told the state URL and asked for the
        rollouts in flight: those it takes back run on (status, cancellation, result as
        usual); only the rest fail by the restart, with its note appended."""
        path, copy = tmp_path / "state.db", tmp_path / "after-crash.db"
        first = await make_harness(state=url(path))
        tokens = {rid: await first.admit(rid) for rid in ("back", "stopped", "lost")}
        for rid in tokens:
            await first.backend.started(rid)
        await stored_writes(first, 3)
        crash_copy(path, copy)
        old_process = first.server.process_id
        release = asyncio.Event()
        seen_cancel = asyncio.Event()

        async def back() -> ExecutionOutcome:
            await release.wait()
            return ExecutionOutcome(
                workflow=ExecutionResult(
                    status=RolloutStatus.SUCCESS, sample=Sample(messages=[], reward=1.0)
                )
            )

        async def stopped() -> ExecutionOutcome:
            try:
                await asyncio.get_running_loop().create_future()
            finally:
                seen_cancel.set()
            raise AssertionError("unreachable")

        class Reattaching(type(first.backend)):  # type: ignore[misc]
            bound: str | None = None
            asked: tuple[str, ...] = ()

            def _bind_state(self, state_url: str) -> None:
                self.bound = state_url

            async def _reattach(self, on_status: Any) -> Reattached:
                self.asked = tuple(sorted(on_status))
                on_status["back"]("running")
                return Reattached(
                    running={"back": back(), "stopped": stopped()}, note="; worker 3 ended too"
                )

        backend = Reattaching()
        second = await make_harness(backend, state=url(copy))
        assert backend.bound == url(copy)
        assert backend.asked == ("back", "lost", "stopped")
        state = (await second.health()).json["state"]
        assert (state["reattached_rollouts"], state["failed_by_restart"]) == (2, 1)
        assert (await second.poll("back", tokens["back"])).json["status"] == "running"
        lost = (await second.poll("lost", tokens["lost"])).json
        assert (lost["status"], lost["err_category"], lost["err_message"]) == (
            "failure",
            "internal_error",
            f"the server process {old_process} ended before the rollout finished; "
            "worker 3 ended too",
        )
        await second.cancel({"ids": ["stopped"]})
        async with asyncio.timeout(EVENT_SEC):
            await seen_cancel.wait()
        reply = await second.poll_until("stopped", tokens["stopped"], "cancelled")
        assert reply.json["status"] == "cancelled"
        release.set()
        reply = await second.poll_until("back", tokens["back"], "success")
        assert reply.json["sample"]["reward"] == 1.0

    async def test_a_second_app_on_the_same_file_fails_to_start(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        path = tmp_path / "state.db"
        first = await make_harness(state=url(path))
        app = create_rollout_server(backend=first.backend, state=url(path))
        runner = web.AppRunner(app)
        try:
            with pytest.raises(StateOpenError, match="is in use by another rollout-server"):
                await runner.setup()
        finally:
            await runner.cleanup()

    async def test_a_start_that_fails_after_opening_the_state_releases_it(
        self, scripted: Any, tmp_path: Path
    ) -> None:
        """A backend whose startup() fails: the app's start fails, and the state file is
        free for the next start."""

        class FailingStart(scripted):  # type: ignore[misc]
            async def startup(self) -> None:
                raise RuntimeError("backend cannot start")

        path = tmp_path / "state.db"
        runner = web.AppRunner(create_rollout_server(backend=FailingStart(), state=url(path)))
        try:
            with pytest.raises(RuntimeError, match="backend cannot start"):
                await runner.setup()
        finally:
            await runner.cleanup()
        store = SqliteStore(path)
        await store.open(process_id="next")
        await store.close()

    async def test_the_collect_window_waits_for_results_the_shutdown_stored(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        """The drain's cancellation publishes (stores) the running rollout's result; the
        collect window opens for it (nobody polled yet) and ends on its delivery, long
        before the window's 30 s."""
        stages = ShutdownTimeouts(
            drain_sec=0.0, cleanup_sec=2.0, force_sec=1.0, backend_sec=1.0, collect_sec=30.0
        )
        harness = await make_harness(state=url(tmp_path / "state.db"), shutdown_timeouts=stages)
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        window_open = asyncio.Event()

        class WindowWatch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "Waiting up to 30.0s for pollers to collect 1 result(s)" in record.getMessage():
                    window_open.set()

        watch = WindowWatch()
        shutdown_logger = logging.getLogger("rollout_server.shutdown")
        level = shutdown_logger.level
        shutdown_logger.addHandler(watch)
        shutdown_logger.setLevel(logging.INFO)
        try:
            drain = asyncio.ensure_future(harness.server.drain())
            async with asyncio.timeout(EVENT_SEC):
                await window_open.wait()
            assert not drain.done()
            reply = await harness.poll_until("r1", token, "cancelled")
            async with asyncio.timeout(EVENT_SEC):
                await drain
        finally:
            shutdown_logger.removeHandler(watch)
            shutdown_logger.setLevel(level)
        assert reply.json["err_message"] == "cancelled"

    async def test_a_lapsed_lease_found_by_a_poll_is_answered_once_stored(
        self, make_harness: MakeHarness, tmp_path: Path
    ) -> None:
        """A poll that finds the lease lapsed (before the lease timer fires) publishes
        lease_expired; with a durable store it waits for the write and answers it (200,
        never a 500)."""
        path = tmp_path / "state.db"
        harness = await make_harness(state=url(path))
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        record = harness.server.registry.get("r1")
        record.lease_deadline = asyncio.get_running_loop().time() - 1.0  # the poll is late
        reply = await harness.poll("r1", token)
        assert reply.status == 200
        assert reply.json["status"] == "failure"
        assert reply.json["err_category"] == "lease_expired"
        assert rows(path)["r1"]["result"] == reply.raw
